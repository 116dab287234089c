"""What a platform provides: everything the engine, the model runner, the sampler and the compiler ask of the
hardware they run on, so that none of them ever branches on a device type.

A platform is one object (`Platform` subclass): a name users pass as the device (`LLM(device="cpu")`), the
torch device type its tensors live on, the `forward_<name>` method its op implementations define, and hooks.
The base class's hooks describe a device with nothing of its own: the hw-agnostic layers, the reference
attention backend, no graph passes, no kernels. A platform overrides what it does better. Its
implementation modules (layers, attention backend, passes) are named by import path and loaded on first
use, so importing `strata.platforms` stays cheap and free of cycles.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from torch import fx

# The reference attention backend: plain PyTorch, correct on every device torch supports.
REFERENCE_ATTENTION_BACKEND = "strata.attention.backends.torch_native.TorchNativeBackend"


class ThreadPolicy:
    """Chooses a step's intra-op thread count (a CPU concern; platforms without one return no policy).

    The runner calls `enter()` before a step and `exit(token)` after it with what `enter` returned, then
    `observe(shape, seconds)` with the step's shape (sequences, tokens) and duration."""

    def enter(self) -> Any:
        raise NotImplementedError

    def exit(self, token: Any) -> None:
        raise NotImplementedError

    def observe(self, shape: tuple[int, int], seconds: float) -> None:
        raise NotImplementedError


class Platform:
    """A device family Strata runs on. Subclass it, set the class attributes and override the hooks that
    differ; register an instance with `strata.platforms.register_platform` (a plugin does so from its
    `register()`)."""

    # The device name users pass (`LLM(device=...)`, `--device`); "name:N" selects device N where it applies.
    name: ClassVar[str]
    # The torch device type this platform's tensors live on.
    device_type: ClassVar[str]
    # The method of this platform's op implementations that enabled ops call (`forward_cpu`, ...).
    forward_method: ClassVar[str]
    # Import paths of modules whose import registers this platform's op implementations.
    layer_modules: ClassVar[Sequence[str]] = ()
    # Import path of the attention backend class (see `strata.attention.backend.AttentionBackend`).
    attention_backend_class: ClassVar[str] = REFERENCE_ATTENTION_BACKEND
    # The torch.distributed backend of the process groups of ranks on this platform.
    distributed_backend: ClassVar[str] = "gloo"

    def is_available(self) -> bool:
        """Whether this machine can run the platform (drivers, devices)."""
        return True

    def torch_device(self, device: str) -> torch.device:
        """The torch device for a device string naming this platform ("cpu", "cuda:1"); ValueError if it
        cannot be used here."""
        if not self.is_available():
            raise ValueError(f"device {device!r}: the {self.name} platform is not available on this machine")
        _, _, index = device.partition(":")
        return torch.device(self.device_type, int(index)) if index else torch.device(self.device_type)

    def rank_device(self, device: torch.device, local_rank: int) -> torch.device:
        """The device of the rank `local_rank` of an engine's ranks on this machine, the engine's being
        `device`: the same for all where they share it (the CPU's cores are split by threads instead)."""
        return device

    # -- start-up -------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Get the platform ready before the first model is built (build or load its kernels)."""

    def load_layers(self) -> None:
        """Import the modules that register this platform's op implementations (idempotent)."""
        for module in self.layer_modules:
            importlib.import_module(module)

    def attention_backend(self, kv_cache_dtype: torch.dtype, reference: bool = False) -> Any:
        """A new instance of this platform's attention backend, for caches of `kv_cache_dtype`; with
        `reference`, the reference backend instead (`layer_impl="hw-agnostic"`: every layer's reference,
        attention included, as a platform with no kernels of its own runs them)."""
        path = REFERENCE_ATTENTION_BACKEND if reference else self.attention_backend_class
        return load_object(path)(kv_cache_dtype)

    # -- memory and threads ---------------------------------------------------------------------------
    def available_memory(self, device: torch.device) -> int:
        """Bytes the KV cache may be sized from (its default takes a share of them)."""
        raise NotImplementedError(f"the {self.name} platform does not report its free memory")

    def thread_policy(self, adaptive: bool) -> ThreadPolicy | None:
        """The per-step thread policy, or None to leave torch's thread count as it is."""
        return None

    # -- compilation ----------------------------------------------------------------------------------
    def start_compile_warmup(self) -> Callable[[], None] | None:
        """Start once-per-process compiler setup in the background; returns the function that waits for it."""
        return None

    def graph_passes(self) -> dict[str, Callable[[fx.GraphModule], int]]:
        """FX passes run on the traced forward before it is split, by name, in order; each returns how many
        replacements it made."""
        return {}

    def inductor_options(self) -> dict[str, Any]:
        """Inductor settings for the compiled pieces on this platform."""
        return {}

    def fast_piece_call(self, artifact: Any) -> Callable[[list[Any]], Any] | None:
        """Where a compiled piece's generated code can be called directly (skipping wrappers that do nothing
        for it), that callable; else None and the piece is called through its artifact."""
        return None

    def compile_cache_key(self) -> str:
        """What, besides the model and the settings, decides whether compiled graphs on disk fit: the kernel
        ops they may call, for example."""
        return self.name

    # -- the step -------------------------------------------------------------------------------------
    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A staged host tensor as `device` sees it."""
        return host.to(device, non_blocking=True)

    def argmax_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (lowest index on ties) of a 2-D tensor: the sampler's greedy choice."""
        return values.argmax(dim=-1)


def load_object(path: str) -> Any:
    """The object at import path "package.module.Name"."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
