"""The life of an engine's processes (`worker.processes`, `worker.executor`): a rank or replica that dies,
fails or hangs while starting ends the start within seconds, naming it, its exit code and its stderr (and
the main-module guard when a script without one re-ran itself in the spawned process); an engine lives
as long as its object: dropped, left through `with`, or at interpreter exit, its ranks stop, and engines
of every layout then follow each other in one process."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from strata import LLM, SamplingParams
from strata.config import ConfigError
from strata.engine.data_parallel import DataParallelEngine
from strata.engine_args import EngineArgs
from strata.worker.processes import ProcessStartError

from stories260k import GREEDY_55, PROMPT

THREAD_ENV = {**os.environ, "STRATA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
SRC = Path(__file__).resolve().parents[2] / "src"
GREEDY = SamplingParams(temperature=0, max_tokens=55)


def spawned_children() -> set[psutil.Process]:
    return {child for child in psutil.Process().children() if "spawn_main" in " ".join(child.cmdline())}


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def on_new_child() -> Iterator[Callable[[Callable[[psutil.Process], bool]], None]]:
    """`on_new_child(act)`: a thread calls `act(child)` on the first child spawned from now on, until it
    returns True (then the child is killed at the end of the test, whatever happened)."""
    before = spawned_children()
    stop = threading.Event()
    acted: list[psutil.Process] = []

    def start(act: Callable[[psutil.Process], bool]) -> None:
        def watch() -> None:
            while not stop.is_set():
                for child in spawned_children() - before:
                    try:
                        if act(child):
                            acted.append(child)
                            return
                    except psutil.NoSuchProcess:
                        pass
                time.sleep(0.01)

        threading.Thread(target=watch, daemon=True).start()

    yield start
    stop.set()
    for child in acted:
        if not gone(child):
            child.kill()


def damaged_checkpoint(folder: Path, target: Path) -> Path:
    """`folder`'s model with the last layer's down projection saved in the wrong shape, as a damaged
    download would have it: only the process that loads that layer fails."""
    target.mkdir()
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            (target / path.name).write_bytes(path.read_bytes())
    [weights] = folder.glob("*.safetensors")
    tensors = load_file(weights)
    name = "model.layers.2.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, target / weights.name, metadata={"format": "pt"})
    return target


def test_a_script_without_the_main_guard_fails_fast_and_says_so(tmp_path: Path) -> None:
    """The spawned rank imports the script, which creates an engine again: multiprocessing refuses to
    spawn from there, the rank exits, and the script's engine fails at once with the advice."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            from strata import LLM, SamplingParams

            llm = LLM(tensor_parallel_size=2)
            print(llm.generate("Once", SamplingParams(max_tokens=2))[0].outputs[0].text)
            """
        )
    )
    env = {**THREAD_ENV, "PYTHONPATH": str(SRC)}
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "tensor-parallel rank 1 exited while starting (exit code 1)" in result.stderr
    assert 'guard the code that creates the engine with `if __name__ == "__main__":`' in result.stderr
    assert "bootstrapping phase" in result.stderr  # the rank's own stderr, quoted
    assert time.monotonic() - start < 240


def test_a_rank_that_fails_to_load_is_named_with_its_exit_code_and_stderr(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Pipeline parallel: rank 1, the last stage, loads the damaged layer; rank 0 does not."""
    folder = damaged_checkpoint(tiny_model_dir("llama"), tmp_path / "damaged")
    before = spawned_children()
    with pytest.raises(ProcessStartError) as failure:
        LLM(str(folder), skip_tokenizer_init=True, pipeline_parallel_size=2)
    message = str(failure.value)
    assert message.startswith("pipeline-parallel rank 1 failed to start (exit code 1): WeightLoadError: ")
    assert "model.layers.2.mlp.down_proj.weight" in message
    assert "its stderr ended with" in message or "it wrote nothing to stderr" in message
    assert all(gone(child) for child in spawned_children() - before)
    assert not torch.distributed.is_initialized()


def kill(child: psutil.Process) -> bool:
    child.kill()
    return True


def suspend_once_it_beats(child: psutil.Process) -> bool:
    """Suspended once its heartbeat thread runs (it has two threads), before it can have built its model."""
    if child.num_threads() < 2:
        return False
    child.suspend()
    return True


@pytest.mark.parametrize(
    ("act", "failure"),
    [(kill, r"exited while starting \(exit code -9\)"), (suspend_once_it_beats, "stopped answering while starting")],
)
def test_a_rank_killed_or_suspended_while_starting_fails_the_start_fast(
    on_new_child: Callable[[Callable[[psutil.Process], bool]], None],
    monkeypatch: pytest.MonkeyPatch,
    act: Callable[[psutil.Process], bool],
    failure: str,
) -> None:
    if act is suspend_once_it_beats:  # a short silence is enough to call it hung; a killed one needs none
        monkeypatch.setenv("STRATA_HEARTBEAT_TIMEOUT", "2")
    on_new_child(act)
    start = time.monotonic()
    with pytest.raises(ProcessStartError, match=f"^tensor-parallel rank 1 {failure}"):
        LLM(tensor_parallel_size=2)
    assert time.monotonic() - start < 60
    assert not torch.distributed.is_initialized()


def test_a_replica_that_fails_to_load_is_named(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    folder = damaged_checkpoint(tiny_model_dir("llama"), tmp_path / "damaged")
    config = EngineArgs(str(folder), skip_tokenizer_init=True).create_engine_config()
    config.parallel_config = replace(config.parallel_config, data_parallel_size=2)
    before = set(psutil.Process().children())
    with pytest.raises(ProcessStartError, match=r"^data-parallel replica [01] failed to start \(exit code 1\): "
                       r"WeightLoadError: tensor model.layers.2.mlp.down_proj.weight"):  # fmt: skip
        DataParallelEngine(config)
    assert all(gone(child) for child in set(psutil.Process().children()) - before)


def test_engines_of_every_layout_follow_each_other_when_dropped() -> None:
    """One process, tensor parallel, pipeline parallel, in turns: each engine dropped (`del`, gc) or
    left through `with` stops its ranks and leaves the process group, so the next one, of any layout,
    works. A second multi-process engine while one lives is refused before it spawns anything."""
    layouts = [{"tensor_parallel_size": 2}, {}, {"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}, {}]
    threads = torch.get_num_threads()
    for options in layouts:
        before = spawned_children()
        llm = LLM(**options)
        ranks = spawned_children() - before
        assert len(ranks) == (1 if options else 0)
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == GREEDY_55
        if options:
            with pytest.raises(ConfigError, match="another multi-process engine runs in this process"):
                LLM(**options)
            assert spawned_children() - before == ranks
        del llm
        gc.collect()
        deadline = time.monotonic() + 30
        while not all(gone(rank) for rank in ranks):
            assert time.monotonic() < deadline, "the dropped engine's ranks still run"
            time.sleep(0.1)
        assert not torch.distributed.is_initialized()
        assert torch.get_num_threads() == threads  # rank 0's share of the cores given back
    with LLM(pipeline_parallel_size=2) as llm:
        ranks = spawned_children()
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == GREEDY_55
    assert all(gone(rank) for rank in ranks) and not torch.distributed.is_initialized()


def test_interpreter_exit_stops_the_ranks(tmp_path: Path) -> None:
    """A script that never shuts its engine down: its engine stops its rank at exit (multiprocessing
    would only terminate it)."""
    script = tmp_path / "no_shutdown.py"
    script.write_text(
        textwrap.dedent(
            """
            import logging

            import psutil
            from strata import LLM, SamplingParams

            if __name__ == "__main__":
                logging.basicConfig(level=logging.INFO)
                llm = LLM(tensor_parallel_size=2)
                ranks = psutil.Process().children()
                print(*[rank.pid for rank in ranks if "spawn_main" in " ".join(rank.cmdline())], flush=True)
                print(llm.generate("Once", SamplingParams(max_tokens=2))[0].outputs[0].text)
            """
        )
    )
    env = {**THREAD_ENV, "PYTHONPATH": str(SRC)}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    [rank] = [int(pid) for pid in result.stdout.splitlines()[0].split()]
    assert "the tensor-parallel ranks stopped" in result.stderr
    assert not psutil.pid_exists(rank) or gone(psutil.Process(rank))
