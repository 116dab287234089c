"""The CPU platform: Strata's C++ kernels (`csrc/`, built by `kernels.py`), the layers and the attention
backend on them, the thread policy, and what `torch.compile` needs on the CPU (Inductor's setup, the
graph passes over the kernels' ops)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from strata import envs
from strata.platforms.cpu import host_memory, kernels
from strata.platforms.interface import Platform, ThreadPolicy

# Logit dtypes whose rows go to the argmax kernel (widened to float32 first: exact, so ties fall the same).
_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    forward_method = "forward_cpu"
    layer_modules = ("strata.platforms.cpu.layers",)
    attention_backend_class = "strata.platforms.cpu.attention.CpuAttentionBackend"

    def prepare(self) -> None:
        kernels.build_all()

    def available_memory(self, device: torch.device) -> int:
        return host_memory.available_bytes()

    def thread_policy(self, adaptive: bool) -> ThreadPolicy | None:
        from strata.platforms.cpu.thread_tuner import ThreadTuner

        threads = torch.get_num_threads()
        return ThreadTuner(threads) if adaptive and threads > 1 else None

    def start_compile_warmup(self) -> Callable[[], None]:
        from strata.platforms.cpu.inductor import InductorWarmup

        return InductorWarmup().wait

    def graph_passes(self) -> dict[str, Callable[[Any], int]]:
        from strata.platforms.cpu.passes import (
            fuse_residual_add_into_rms_norm,
            group_sibling_linears,
            linears_to_onednn,
        )

        return {
            "fuse_residual_add_into_rms_norm": fuse_residual_add_into_rms_norm,
            "group_sibling_linears": group_sibling_linears,
            "linears_to_onednn": linears_to_onednn,
        }

    def inductor_options(self) -> dict[str, Any]:
        # Its C++ wrapper calls a piece's ops with no Python between them.
        return {"cpp_wrapper": True}

    def fast_piece_call(self, artifact: Any) -> Callable[[list[Any]], Any] | None:
        from strata.platforms.cpu.inductor import inductor_code

        return inductor_code(artifact)

    def compile_cache_key(self) -> str:
        # Compiled graphs call the kernels' ops where they load, with the schemas their sources define.
        return "cpu:" + ("no-kernels" if envs.disable_cpu_kernels() else kernels.sources_digest())

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host  # host memory is this device's memory

    def argmax_rows(self, values: torch.Tensor) -> torch.Tensor:
        if values.dtype in _ARGMAX_DTYPES and kernels.load("argmax"):
            return torch.ops.strata_cpu.argmax_rows(values.float())
        return values.argmax(dim=-1)
