"""Where a model's checkpoint tensors come from: a folder of safetensors files, or a GGUF file.

Each source streams (parameter name, float tensor) pairs for `load_weights`, one tensor in memory at a
time, and names the parameters it already put in place itself (a GGUF file's blocks kept quantized).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from strata.gguf.weights import GGUFCheckpoint
from strata.models.transformers.quantization import QSCALE_SUFFIX, QWEIGHT_SUFFIX, dequantize_groups
from strata.models.transformers.weight_pipeline import TensorStream, WeightLoadError

# Above this many bytes of weights, show a progress bar while loading.
_PROGRESS_BAR_BYTES = 256 * 1024 * 1024


class WeightSource(Protocol):
    """A checkpoint in one weight format."""

    @property
    def name(self) -> str:
        """The path errors name the checkpoint by."""
        ...

    def open(self, model: nn.Module) -> tuple[TensorStream, set[str]]:
        """The tensors to load into `model`, and the parameters this source already filled."""
        ...


class SafetensorsFolder:
    """A folder of `.safetensors` files (sharded with an index, or not); int8 `qweight` + `qscale` pairs of
    a folder stored quantized arrive dequantized, one pair at a time."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.name = str(folder)

    def open(self, model: nn.Module) -> tuple[TensorStream, set[str]]:
        return _dequantize_pairs(_iter_checkpoint(_checkpoint_files(self.folder))), set()


class GGUFSource:
    """A GGUF file whose quantized blocks the model's GGUF layers already hold (`GGUFCheckpoint`): they are
    put in place first, every other tensor is streamed dequantized."""

    def __init__(self, gguf: GGUFCheckpoint) -> None:
        self.gguf = gguf
        self.name = str(gguf.path)

    def open(self, model: nn.Module) -> tuple[TensorStream, set[str]]:
        preloaded = self.gguf.load_kept(model)
        return self.gguf.dense_tensors(), preloaded


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no .safetensors weights in {folder}")
    return files


def _iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) pairs, one tensor in memory at a time."""
    total = sum(f.stat().st_size for f in files)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="Loading weights", disable=total < _PROGRESS_BAR_BYTES
    ) as bar:
        for path in files:
            with safe_open(path, framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensor = reader.get_tensor(name)
                    bar.update(tensor.numel() * tensor.element_size())
                    yield name, tensor


def _dequantize_pairs(items: TensorStream) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass float tensors through; turn each `<x>.qweight` + `<x>.qscale` pair into one float `<x>.weight`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        suffix = next((s for s in (QWEIGHT_SUFFIX, QSCALE_SUFFIX) if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name.removesuffix(suffix)
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) == 2:
            del pending[base]
            yield f"{base}.weight", dequantize_groups(base, parts[QWEIGHT_SUFFIX], parts[QSCALE_SUFFIX])
    for base, parts in pending.items():
        (have,) = parts
        lacks = QSCALE_SUFFIX if have == QWEIGHT_SUFFIX else QWEIGHT_SUFFIX
        raise WeightLoadError(f"quantized tensor {base}{have} has no {base}{lacks} in the checkpoint")
