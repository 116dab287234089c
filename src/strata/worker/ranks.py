"""A multi-process engine's ranks: rank 0 runs in the engine's process, the others in processes it spawns
on this machine, or that torchrun started (on this machine or others) running `run_rank`. What is common
to every kind of rank: starting and joining them, keeping idle ones alive, failing fast when one dies
or hangs, stopping them. How a step reaches them is the kind's own (`worker.tensor_parallel`,
`worker.pipeline_parallel`).

Every rank builds its part of the model (`models.transformers.tensor_parallel` shards it,
`models.transformers.pipeline_parallel` splits it into stages) and its share of the KV cache. Rank 0
schedules and samples: each step it plans the inputs (plain lists) and sends the plan to the other
ranks. With tensor parallelism all ranks run the same forward, meeting in the sharded layers'
collectives, and rank 0 keeps the logits; pipeline stages pass the plan on with their activations. A rank that fails to build reports why before the engine starts, so the
error names it; at shutdown rank 0 sends `None` and the others exit.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import ClassVar

import torch

from strata.config import ConfigError, EngineConfig
from strata.distributed.communication import gather_objects, min_over_ranks
from strata.distributed.parallel_state import (
    free_local_init_method,
    init_distributed,
    same_machine,
    set_watchdog,
    shutdown_distributed,
    torchrun_rank,
)
from strata.worker.model_runner import ModelRunner

logger = logging.getLogger("strata.worker.ranks")

# How often rank 0 looks at the other ranks while it waits for them to build their shards.
_POLL_SECONDS = 0.1
# The message rank 0 sends the others while the engine is idle, so their wait for a step never times out.
KEEPALIVE = "keepalive"


class RankFailedError(RuntimeError):
    """A rank died or stopped answering: the sharded model is incomplete and the engine cannot go on."""


class MultiRankRunner(ModelRunner):
    """Rank 0's runner: spawns ranks 1..N-1 on this machine (or joins those torchrun started), builds its
    own part of the model, and sends each step's plan to the other ranks (`_send`), which run it in their
    `serve_rank` loop."""

    KIND: ClassVar[str]  # "tensor-parallel", ...: how errors name the ranks

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel_config
        if torch.distributed.is_initialized():
            raise ConfigError(
                "another multi-process engine runs in this process: shut it down first (LLM.shutdown())"
            )
        self.world_size = world = parallel.world_size
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._reports: list[Connection] = []
        self._running = self._failed = False
        # Steps and keep-alive messages take turns on the process group.
        self._lock = threading.Lock()
        self._stop_keepalive = threading.Event()
        launched = torchrun_rank()
        if launched is not None:
            self._join_launched_ranks(config, *launched)
            return
        init_method = parallel.distributed_init_method or free_local_init_method()
        # Each rank takes its share of the cores.
        threads = max(1, torch.get_num_threads() // world)
        context = multiprocessing.get_context("spawn")
        for rank in range(1, world):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=run_rank,
                args=(type(self), config, rank, init_method, threads, sender),
                name=f"strata-rank-{rank}",
                daemon=True,
            )
            process.start()
            sender.close()
            self._processes.append(process)
            self._reports.append(receiver)
        torch.set_num_threads(threads)
        try:
            init_distributed(
                config.platform.distributed_backend, init_method, 0, world, parallel.distributed_timeout, True,
                parallel.pipeline_parallel_size,
            )  # fmt: skip
            set_watchdog(self._dead_rank)
            super().__init__(config)
            self._wait_for_ranks(parallel.distributed_timeout)
            agree_on_kv_cache(self)
        except BaseException:
            self._failed = True
            self._stop_processes()
            raise
        self._start_keepalive(parallel.distributed_timeout)
        logger.info("%s: %d ranks, %d threads each", self.KIND, world, threads)

    def _join_launched_ranks(self, config: EngineConfig, rank: int, world: int) -> None:
        """Rank 0 of ranks torchrun started: the others run `run_rank` (the CLI sends them there)."""
        parallel = config.parallel_config
        if world != self.world_size or rank != 0:
            raise ConfigError(
                f"torchrun started this process as rank {rank} of {world}, but the engine is rank 0 of "
                f"{self.world_size} ranks: launch as many processes as the model has ranks"
            )
        init_distributed(
            config.platform.distributed_backend,
            "env://",
            0,
            world,
            parallel.distributed_timeout,
            same_machine(),
            parallel.pipeline_parallel_size,
        )
        super().__init__(config)
        failed = [
            (r, detail)
            for r, (status, detail) in enumerate(gather_objects(("ready", None)))
            if status != "ready"
        ]
        if failed:
            rank, detail = failed[0]
            raise ConfigError(f"{self.KIND} rank {rank} failed to start: {detail}")
        agree_on_kv_cache(self)
        self._start_keepalive(parallel.distributed_timeout)
        logger.info("%s: %d ranks launched by torchrun", self.KIND, world)

    def _wait_for_ranks(self, timeout: float) -> None:
        """Until every other rank has built its shard; the first that failed or died is an error naming it."""
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._reports, start=1))
        while pending:
            for rank, report in list(pending.items()):
                if report.poll():
                    status, detail = report.recv()
                    if status != "ready":
                        raise ConfigError(f"{self.KIND} rank {rank} failed to start: {detail}")
                    del pending[rank]
                elif not self._processes[rank - 1].is_alive():
                    code = self._processes[rank - 1].exitcode
                    raise RuntimeError(f"{self.KIND} rank {rank} exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.KIND} ranks {sorted(pending)} did not start within {timeout} s")
            time.sleep(_POLL_SECONDS)

    def _start_keepalive(self, timeout: float) -> None:
        """The other ranks wait for each step in a collective, which times out: while the engine is idle,
        rank 0 sends them an empty message well within the timeout."""
        self._running = True
        self._last_message = time.monotonic()
        interval = timeout / 4

        def keep_alive() -> None:
            while not self._stop_keepalive.wait(interval / 4):
                with self._lock:
                    if self._running and time.monotonic() - self._last_message > interval:
                        self._send(KEEPALIVE)

        threading.Thread(target=keep_alive, name="strata-rank-keepalive", daemon=True).start()

    def _send(self, message: object) -> None:
        """Send a plan (or a control message: `KEEPALIVE`, None to stop) to the other ranks."""
        raise NotImplementedError

    @staticmethod
    def serve_rank(runner: ModelRunner) -> None:
        """A rank past 0, its part of the model built: run the steps rank 0 sends until it sends None."""
        raise NotImplementedError

    @contextmanager
    def _failing_for_good(self) -> Iterator[None]:
        """Around an exchange with the other ranks: any error leaves them out of step, so the engine
        cannot go on; it becomes a RankFailedError naming the rank to blame."""
        if not self._running:
            raise RankFailedError(f"the {self.KIND} ranks are stopped")
        try:
            yield
        except Exception as exc:
            self._running, self._failed = False, True
            raise RankFailedError(self._failure(exc)) from exc

    def _dead_rank(self) -> str | None:
        for rank, process in enumerate(self._processes, start=1):
            if not process.is_alive():
                return f"{self.KIND} rank {rank} died (exit code {process.exitcode})"
        return None

    def _failure(self, exc: Exception) -> str:
        """Why a step failed: the rank that died, else what rank 0 raised (a collective that timed out
        waiting for a hung rank, or an error of its own)."""
        for process in self._processes:
            process.join(timeout=1)  # a rank that just died may still be exiting
        if (dead := self._dead_rank()) is not None:
            return f"{dead} during a step"
        return f"a {self.KIND} step failed on rank 0 with every rank running: {type(exc).__name__}: {exc}"

    def shutdown(self) -> None:
        """Tell the other ranks to exit and wait for them (kill those that cannot be told)."""
        self._stop_keepalive.set()
        with self._lock:
            if self._running:
                self._running = False
                try:
                    self._send(None)
                except (RuntimeError, TimeoutError):
                    logger.warning("could not reach every %s rank to stop it", self.KIND)
        self._stop_processes()

    def _stop_processes(self) -> None:
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes.clear()
        shutdown_distributed()


def agree_on_kv_cache(runner: ModelRunner) -> None:
    """Every rank takes the smallest block count any rank can afford, so block ids mean the same cache
    slots on all of them."""
    runner.resize_kv_cache(min_over_ranks(runner.num_blocks))


def run_rank(
    kind: type[MultiRankRunner],
    config: EngineConfig,
    rank: int,
    init_method: str,
    threads: int,
    report: Connection | None,
) -> None:
    """A rank's life past rank 0: join the group, build its part of the model, say whether that worked (on
    `report`, the pipe of a spawned rank; over the group for one torchrun started), then run the steps of
    rank 0's runner `kind` until rank 0 stops."""
    torch.set_num_threads(threads)
    parallel = config.parallel_config
    init_distributed(
        config.platform.distributed_backend, init_method, rank, parallel.world_size,
        parallel.distributed_timeout, init_method != "env://" or same_machine(), parallel.pipeline_parallel_size,
    )  # fmt: skip
    try:
        runner = ModelRunner(config)
        status = ("ready", None)
    except Exception as exc:
        status = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    if report is not None:
        report.send(status)
        report.close()
    else:
        gather_objects(status)
    if status[0] != "ready":
        raise SystemExit(1)
    parent = multiprocessing.parent_process()
    if parent is not None:
        set_watchdog(lambda: None if parent.is_alive() else "rank 0 died")
    agree_on_kv_cache(runner)
    kind.serve_rank(runner)
    shutdown_distributed()
