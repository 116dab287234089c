"""Inductor on the CPU: its once-per-process setup, remembered per machine and run in the background, and
calling the code it generates for a piece directly.

Running a compiled piece on the CPU makes Inductor pick the SIMD instruction set. It checks each candidate
the CPU lists by building a probe and loading it in a child Python process: about 0.2 s per candidate,
1.4 s on an AVX-512 machine, in every process. The outcome is a property of the machine, so Strata records
it (per CPU, torch version and compiler) under `STRATA_CACHE_ROOT`; where every candidate passed, later
processes set Inductor's own switch for a machine known to pass (`cpp.vec_isa_ok`) and skip the probes.
The check runs on a background thread while the engine builds its model; Inductor's settings are
thread-local, so the switch stays the checking thread's, and the process keeps only the instruction sets it
found (Inductor caches them per process).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from strata import envs
from strata.atomic_file import write_atomically
from strata.compilation.inductor_artifact import closure_values, wrapper_chain
from strata.platforms.cpu.kernels import cpu_description

logger = logging.getLogger("strata.compilation")


def _record_path() -> Path:
    key = "\n".join([cpu_description(), torch.__version__, os.environ.get("CXX", "")])
    return (
        Path(envs.cache_root()) / "inductor" / f"vec-isa-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    )


def _candidates() -> list[str]:
    """The instruction sets Inductor would probe here: those whose CPU flags the machine lists (x86 only;
    elsewhere Inductor does not probe)."""
    from torch._inductor import cpu_vec_isa

    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [
        str(isa) for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())
    ]


def check_instruction_sets() -> None:
    """Pick Inductor's instruction set for this process, using and keeping the per-machine record."""
    from torch._inductor import config, cpu_vec_isa

    path = _record_path()
    candidates = _candidates()
    if config.cpp.vec_isa_ok is None and candidates and path.is_file():
        config.cpp.vec_isa_ok = json.loads(path.read_text()).get("passed") == candidates or None
    cpu_vec_isa.pick_vec_isa()  # cached for the process
    if config.cpp.vec_isa_ok is None and candidates:
        passed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
        write_atomically(path, lambda tmp: tmp.write_text(json.dumps({"passed": passed})))


def _check_in_background() -> None:
    try:
        check_instruction_sets()
    except Exception as exc:  # the engine's own load hits the same path and reports it there
        logger.debug("Inductor's instruction-set check failed in the background: %s", exc)


class InductorWarmup:
    """Starts Inductor's instruction-set check on a background thread; `wait` before compiling or loading."""

    def __init__(self) -> None:
        self._thread = threading.Thread(
            target=_check_in_background, name="strata-inductor-warmup", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()


# The wrappers between a `standalone_compile` artifact (fresh or loaded) and Inductor's `CompiledFxGraph` that
# `inductor_code` steps over, by code name. For a piece traced for inference none changes what it computes.
_PASS_THROUGH_WRAPPERS = frozenset(
    {
        "CacheCompiledArtifact._load_impl.<locals>.<lambda>",  # packs the arguments into a list
        "DisableContext.__call__.<locals>._fn",  # keeps Dynamo off during the call
        "aot_module_simplified.<locals>.forward",  # prepends lifted parameters: required to be none
        "_create_runtime_wrapper.<locals>.runtime_wrapper",  # grad mode, first-call op checks, output views
    }
)


def inductor_code(artifact: Any) -> Callable[[list[Any]], Any] | None:
    """The code Inductor generated for a CPU piece, callable on a list of inputs; None for any other artifact.

    `standalone_compile`'s artifact reaches that code through AOTAutograd's runtime wrapper and Inductor's
    `CompiledFxGraph.__call__`, a visible share of a small piece's time at batch 1. The path is
    followed only through the known `_PASS_THROUGH_WRAPPERS`; any other wrapper (one that adds inputs, say)
    leaves the piece on its artifact. Tests check that the pinned torch's artifacts are recognised.
    """
    from torch._functorch._aot_autograd.runtime_wrappers import SerializableCompiledFunction
    from torch._inductor.output_code import CompiledFxGraph

    for fn in wrapper_chain(artifact):
        if isinstance(fn, CompiledFxGraph):
            return fn.current_callable if set(fn.device_types) <= {"cpu"} else None
        if isinstance(fn, SerializableCompiledFunction):
            continue
        code = getattr(fn, "__code__", None)
        if code is None or code.co_qualname not in _PASS_THROUGH_WRAPPERS:
            return None
        if closure_values(fn).get("params_buffers_flat"):
            return None
    return None
