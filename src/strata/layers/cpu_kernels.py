"""Strata's own CPU kernels: C++ sources in `csrc/`, compiled on first use and loaded as torch ops.

A kernel is built once per machine (`-O3 -march=native`, so the compiler vectorises for this CPU;
`STRATA_CPU_KERNEL_TARGET` names another CPU, as a cache shared by several machines needs) into
`STRATA_CACHE_ROOT/kernels/`, keyed by a hash of its source and the headers beside it (`csrc/*.h`, which
the kernels share), the compiler flags, torch's version and the CPU. Building needs a C++ compiler (`CXX`, else `c++`); without one, or with `STRATA_DISABLE_CPU_KERNELS=1`,
`load` returns False and the layers use ATen. Two processes building at once each write a private file and
rename it into place.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch
import torch.utils.cpp_extension

from strata import envs

logger = logging.getLogger("strata.layers.cpu_kernels")


def cpu_description() -> str:
    """What `-march=native` compiles for: the CPU model and flags (Linux), else the processor name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))


def compile_command(compiler: str, source: Path, target: str) -> list[str]:
    cpu = envs.cpu_kernel_target()
    march = f"-march={cpu}" if platform.machine() in ("x86_64", "AMD64", "i686") else f"-mcpu={cpu}"
    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    libraries = torch.utils.cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler, "-O3", march, "-fopenmp", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *includes, str(source), *[f"-L{path}" for path in libraries], "-ltorch", "-ltorch_cpu", "-lc10",
        *[f"-Wl,-rpath,{path}" for path in libraries], "-o", target,
    ]  # fmt: skip


def _build(name: str, compiler: str) -> Path:
    source = Path(str(resources.files("strata.layers") / "csrc" / f"{name}.cpp"))
    command = compile_command(compiler, source, "TARGET")
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        "\n".join([source.read_text(), *headers, *command, torch.__version__, cpu_description()]).encode()
    ).hexdigest()[:20]
    target = Path(envs.cache_root()) / "kernels" / f"{name}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    start = time.perf_counter()
    try:
        subprocess.run(
            [tmp if arg == "TARGET" else arg for arg in command], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the CPU kernel %s in %.1f s: %s", name, time.perf_counter() - start, target)
    return target


@functools.cache
def sources_digest() -> str:
    """A hash of every kernel source and header: compiled graphs that call the kernels' ops are valid only
    for the op schemas these sources define."""
    folder = Path(str(resources.files("strata.layers") / "csrc"))
    digest = hashlib.sha256()
    for path in sorted([*folder.glob("*.cpp"), *folder.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


@functools.cache
def load(name: str) -> bool:
    """Build (once per machine) and load the kernel `name`; False, with one warning, where that fails."""
    if envs.disable_cpu_kernels():
        return False
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        logger.warning(
            "no C++ compiler (%s) found: Strata's CPU kernel %s is off, ATen is used", compiler, name
        )
        return False
    try:
        torch.ops.load_library(str(_build(name, compiler)))
    except subprocess.CalledProcessError as exc:
        logger.warning("building Strata's CPU kernel %s failed, ATen is used:\n%s", name, exc.stderr[-2000:])
        return False
    except OSError as exc:
        logger.warning("loading Strata's CPU kernel %s failed, ATen is used: %s", name, exc)
        return False
    _FAKE_REGISTRATIONS[name]()
    return True


def _register_linear_fake() -> None:
    """Output shapes of `strata_cpu::linear`, `linear_group` and `linear_glu` for `torch.compile`, which traces
    with fake tensors."""

    @torch.library.register_fake("strata_cpu::linear")
    def _linear_fake(
        x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("strata_cpu::linear_group")
    def _linear_group_fake(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        return x.new_empty(x.shape[0], sum(weight.shape[0] for weight in weights))

    @torch.library.register_fake("strata_cpu::linear_glu")
    def _linear_glu_fake(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0] // 2)


def _register_paged_decode_attention_fake() -> None:
    """Output shape of `strata_cpu::paged_decode_attention` for `torch.compile`: [B, H, Dv] in query's dtype."""

    @torch.library.register_fake("strata_cpu::paged_decode_attention")
    def _paged_decode_attention_fake(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        softcap: float,
        sliding_window: int,
    ) -> torch.Tensor:
        return query.new_empty(query.shape[0], query.shape[1], v_cache.shape[-1])


def _register_rms_norm_fake() -> None:
    """Outputs of `strata_cpu::rms_norm` and `strata_cpu::fused_add_rms_norm` for `torch.compile`: x's shape,
    in x's dtype for Gemma's norm (`weight_offset`) and in `weight * x`'s for Llama's; the sum in x's."""

    def out_dtype(x: torch.Tensor, weight: torch.Tensor, weight_offset: bool) -> torch.dtype:
        return x.dtype if weight_offset else torch.promote_types(x.dtype, weight.dtype)

    @torch.library.register_fake("strata_cpu::rms_norm")
    def _rms_norm_fake(
        x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: bool
    ) -> torch.Tensor:
        return x.new_empty(x.shape, dtype=out_dtype(x, weight, weight_offset))

    @torch.library.register_fake("strata_cpu::fused_add_rms_norm")
    def _fused_add_rms_norm_fake(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape, dtype=out_dtype(x, weight, weight_offset)), x.new_empty(x.shape)


def _register_argmax_fake() -> None:
    """Output of `strata_cpu::argmax_rows` for `torch.compile`: one int64 index per row."""

    @torch.library.register_fake("strata_cpu::argmax_rows")
    def _argmax_rows_fake(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], dtype=torch.int64)


# Each kernel's ops need their fake implementations registered once the library is loaded.
_FAKE_REGISTRATIONS = {
    "argmax": _register_argmax_fake,
    "small_batch_linear": _register_linear_fake,
    "paged_decode_attention": _register_paged_decode_attention_fake,
    "rms_norm": _register_rms_norm_fake,
}
