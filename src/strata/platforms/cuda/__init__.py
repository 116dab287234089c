"""The CUDA platform: Triton kernels for the norms and activations (`layers.py`, `triton_kernels.py`); the
linears run ATen's GEMMs (the reference) and attention runs the reference backend's SDPA calls on the GPU."""

from __future__ import annotations

import torch

from strata.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    distributed_backend = "nccl"
    device_type = "cuda"
    forward_method = "forward_cuda"
    layer_modules = ("strata.platforms.cuda.layers",)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def torch_device(self, device: str) -> torch.device:
        torch_device = super().torch_device(device)
        if torch_device.index is not None and torch_device.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices")
        return torch_device

    def rank_device(self, device: torch.device, local_rank: int) -> torch.device:
        """A GPU each: "cuda" becomes the rank's own (nccl refuses two ranks on one device); a device the
        user named stays theirs."""
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # where nccl's object collectives put their tensors
        return device

    def available_memory(self, device: torch.device) -> int:
        free, _ = torch.cuda.mem_get_info(device)
        return free
