"""Strata's own CPU kernels: C++ sources in `csrc/`, built for this machine and loaded as torch ops.

Each kernel is one shared library, built with `-O3 -march=native` (`STRATA_CPU_KERNEL_TARGET` names another
CPU, as a cache shared by several machines needs) into `STRATA_CACHE_ROOT/kernels/`, keyed by a hash of its
source, the headers beside it (`csrc/*.h`), the compiler flags, torch's version and the CPU. The platform
builds the missing ones before the first model loads (`build_all`: in parallel, with a progress bar); a
kernel asked for before that is built on first use. Building needs a C++ compiler (`CXX`, else `c++`);
without one, or with `STRATA_DISABLE_CPU_KERNELS=1`, `load` returns False and the layers that need the
kernel decline (the resolver then picks the next implementation). Two processes building at once each
write a private file and rename it into place.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import torch
import torch.utils.cpp_extension
from tqdm import tqdm

from strata import envs
from strata.atomic_file import write_atomically
from strata.gguf.quants import block_layout

logger = logging.getLogger("strata.platforms.cpu")

# Every kernel library, by its source's name in `csrc/`.
KERNELS = ("small_batch_linear", "rms_norm", "paged_decode_attention", "argmax", "gguf_linear")


def csrc_dir() -> Path:
    """The folder of the kernels' C++ sources and headers, as installed."""
    return Path(str(resources.files("strata.platforms.cpu") / "csrc"))


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


def _compiler() -> str | None:
    """The C++ compiler to build with, or None (with a warning, once) where there is none."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        _warn_once(f"no C++ compiler ({compiler}) found: Strata's CPU kernels are off")
        return None
    return compiler


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def _library(name: str, compiler: str) -> tuple[Path, list[str]]:
    """Where kernel `name`'s library goes, and the command that builds it (its output "TARGET")."""
    source = csrc_dir() / f"{name}.cpp"
    command = compile_command(compiler, source, "TARGET")
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256(
        "\n".join([source.read_text(), *headers, *command, torch.__version__, cpu_description()]).encode()
    ).hexdigest()[:20]
    return Path(envs.cache_root()) / "kernels" / f"{name}-{key}.so", command


def _build(target: Path, command: list[str]) -> None:
    """Run `command` into a private file beside `target`, then rename it into place."""
    write_atomically(
        target,
        lambda tmp: subprocess.run(
            [str(tmp) if arg == "TARGET" else arg for arg in command], check=True, capture_output=True, text=True
        ),
    )


def build_all() -> None:
    """Build every kernel not built for this machine yet, in parallel, with a progress bar; then load them.
    Kernels that fail to build are reported and left off, as `load` would."""
    if envs.disable_cpu_kernels() or (compiler := _compiler()) is None:
        return
    missing = {name: _library(name, compiler) for name in KERNELS}
    missing = {name: job for name, job in missing.items() if not job[0].is_file()}
    if missing:
        logger.info("building Strata's CPU kernels for this machine (once): %s", ", ".join(missing))
        workers = min(len(missing), os.cpu_count() or 1)
        with (
            concurrent.futures.ThreadPoolExecutor(workers) as pool,
            tqdm(total=len(missing), desc="Building CPU kernels", unit="kernel") as bar,
        ):
            futures = {pool.submit(_build, *job): name for name, job in missing.items()}
            for future in concurrent.futures.as_completed(futures):
                if (error := future.exception()) is not None:
                    _report_failure(futures[future], error)
                bar.update(1)
    for name in KERNELS:
        load(name)


def _report_failure(name: str, error: BaseException) -> None:
    details = error.stderr[-2000:] if isinstance(error, subprocess.CalledProcessError) else str(error)
    _warn_once(
        f"building Strata's CPU kernel {name} failed; the layers that need it use other code:\n{details}"
    )


@functools.cache
def sources_digest() -> str:
    """A hash of every kernel source and header: compiled graphs that call the kernels' ops are valid only
    for the op schemas these sources define."""
    folder = csrc_dir()
    digest = hashlib.sha256()
    for path in sorted([*folder.glob("*.cpp"), *folder.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


@functools.cache
def load(name: str) -> bool:
    """Load kernel `name`, building it first where `build_all` has not; False where either fails."""
    if envs.disable_cpu_kernels() or (compiler := _compiler()) is None:
        return False
    target, command = _library(name, compiler)
    try:
        if not target.is_file():
            _build(target, command)
        torch.ops.load_library(str(target))
    except (subprocess.CalledProcessError, OSError) as exc:
        _report_failure(name, exc)
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


def _register_gguf_fake() -> None:
    """Outputs of `strata_cpu::gguf_linear` ([M, N] float32) and `strata_cpu::gguf_embedding` (float32
    [*ids.shape, K], K from the row's bytes) for `torch.compile`."""

    @torch.library.register_fake("strata_cpu::gguf_linear")
    def _gguf_linear_fake(
        x: torch.Tensor, qweight: torch.Tensor, qtype: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], qweight.shape[0], dtype=torch.float32)

    @torch.library.register_fake("strata_cpu::gguf_embedding")
    def _gguf_embedding_fake(qweight: torch.Tensor, ids: torch.Tensor, qtype: int) -> torch.Tensor:
        elems, size = block_layout(qtype)
        return qweight.new_empty(*ids.shape, qweight.shape[1] // size * elems, dtype=torch.float32)


# Each kernel's ops need their fake implementations registered once the library is loaded.
_FAKE_REGISTRATIONS = {
    "argmax": _register_argmax_fake,
    "small_batch_linear": _register_linear_fake,
    "paged_decode_attention": _register_paged_decode_attention_fake,
    "rms_norm": _register_rms_norm_fake,
    "gguf_linear": _register_gguf_fake,
}
