"""A multi-process engine's ranks: rank 0 runs in the engine's process, the others in processes it spawns
on this machine, or that torchrun started (on this machine or others) running `run_rank`. What is common
to every kind of rank: starting and joining them (their processes' life is `worker.processes`'), keeping
idle ones alive, failing fast when one dies or hangs, stopping them. How a step reaches them is the
kind's own (`worker.tensor_parallel`, `worker.pipeline_parallel`).

Every rank builds its part of the model (`models.transformers.tensor_parallel` shards it,
`models.transformers.pipeline_parallel` splits it into stages) and its share of the KV cache. Rank 0
schedules and samples: each step it plans the inputs (plain lists) and sends the plan to the other
ranks. With tensor parallelism all ranks run the same forward, meeting in the sharded layers'
collectives, and rank 0 keeps the logits; pipeline stages pass the plan on with their activations. A rank
that fails to build reports why before the engine starts, so the error names it; at shutdown (or when the
engine's last reference goes) rank 0 sends `None` and the others exit.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from strata.worker.executor import Executor
from strata.worker.model_runner import ModelRunner
from strata.worker.processes import EXIT_SECONDS, Spawned, StartReport, spawn, stop, wait_for

logger = logging.getLogger("strata.worker.ranks")

# The message rank 0 sends the others while the engine is idle, so their wait for a step never times out.
KEEPALIVE = "keepalive"


class RankFailedError(RuntimeError):
    """A rank died or stopped answering: the sharded model is incomplete and the engine cannot go on."""


class RankGroup:
    """Rank 0's side of the other ranks: their processes, the keep-alive thread, the watchdog, stopping
    them. The executor holds it, never the other way round, so the threads and the executor's finalizer
    do not keep the executor (and its engine) alive."""

    def __init__(self, kind: str, send_control: Callable[[object], None]) -> None:
        self.kind = kind
        self.children: list[Spawned] = []
        self.running = False
        # Steps and keep-alive messages take turns on the process group.
        self.lock = threading.Lock()
        self.last_message = time.monotonic()
        self._send_control = send_control
        self._stop_keepalive = threading.Event()
        self._stopped = False
        # The process's torch threads before rank 0 took its share: given back at shutdown, so an engine
        # started after this one gets the cores again.
        self.threads_before = torch.get_num_threads()

    def send(self, message: object) -> None:
        """A control message (`KEEPALIVE`, None to stop) to the other ranks; the caller holds `lock`."""
        self._send_control(message)
        self.last_message = time.monotonic()

    def start_keepalive(self, timeout: float) -> None:
        """The other ranks wait for each step in a collective, which times out: while the engine is idle,
        rank 0 sends them an empty message well within the timeout."""
        self.running = True
        self.last_message = time.monotonic()
        interval = timeout / 4

        def keep_alive() -> None:
            while not self._stop_keepalive.wait(interval / 4):
                with self.lock:
                    if self.running and time.monotonic() - self.last_message > interval:
                        self.send(KEEPALIVE)

        threading.Thread(target=keep_alive, name="strata-rank-keepalive", daemon=True).start()

    @contextmanager
    def failing_for_good(self) -> Iterator[None]:
        """Around an exchange with the other ranks: any error leaves them out of step, so the engine
        cannot go on; it becomes a RankFailedError naming the rank to blame."""
        if not self.running:
            raise RankFailedError(f"the {self.kind} ranks are stopped")
        try:
            yield
        except Exception as exc:
            self.running = False
            raise RankFailedError(self._failure(exc)) from exc

    def dead_rank(self) -> str | None:
        """What every shared-memory wait of rank 0 asks: which rank died, if one did."""
        for rank, child in enumerate(self.children, start=1):
            if not child.process.is_alive():
                return f"{self.kind} rank {rank} died (exit code {child.process.exitcode})"
        return None

    def _failure(self, exc: Exception) -> str:
        """Why a step failed: the rank that died, else what rank 0 raised (a collective that timed out
        waiting for a hung rank, or an error of its own)."""
        for child in self.children:
            child.process.join(timeout=1)  # a rank that just died may still be exiting
        if (dead := self.dead_rank()) is not None:
            return f"{dead} during a step"
        return f"a {self.kind} step failed on rank 0 with every rank running: {type(exc).__name__}: {exc}"

    def shutdown(self, grace: float = EXIT_SECONDS) -> None:
        """Tell the other ranks to exit and wait `grace` seconds for them (kill those that cannot be told,
        and after a failed start, `grace` 0, all of them), then leave the
        process group. Only once: a later call (the finalizer of an engine already shut down) must not
        touch the process group of an engine started since."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_keepalive.set()
        with self.lock:
            if self.running:
                self.running = False
                try:
                    self.send(None)
                except (RuntimeError, TimeoutError):
                    logger.warning("could not reach every %s rank to stop it", self.kind)
        stop(self.children, grace)
        for child in self.children:
            child.conn.close()
        self.children.clear()
        shutdown_distributed()
        torch.set_num_threads(self.threads_before)
        logger.info("the %s ranks stopped", self.kind)


class MultiRankExecutor(Executor):
    """Rank 0's executor: spawns ranks 1..N-1 on this machine (or joins those torchrun started), builds its
    own part of the model (`runner`), and sends each step's plan to the other ranks, which run it in their
    `serve_rank` loop. Dropping it (with its engine) stops them, as `shutdown` does."""

    KIND: ClassVar[str]  # "tensor-parallel", ...: how errors name the ranks

    def __init__(self, config: EngineConfig) -> None:
        super().__init__()
        parallel = config.parallel_config
        if torch.distributed.is_initialized():  # before anything is spawned
            raise ConfigError(
                "another multi-process engine runs in this process: shut it down first (LLM.shutdown(), or "
                "drop it)"
            )
        self.world_size = parallel.world_size
        self._ranks = ranks = RankGroup(self.KIND, type(self).send_control)
        self._finalizer = weakref.finalize(self, ranks.shutdown)
        try:
            launched = torchrun_rank()
            if launched is not None:
                self._join_launched_ranks(config, *launched)
            else:
                self._spawn_ranks(config)
            agree_on_kv_cache(self.runner)
        except BaseException:
            ranks.shutdown(grace=0)
            raise
        ranks.start_keepalive(parallel.distributed_timeout)

    def _spawn_ranks(self, config: EngineConfig) -> None:
        """Ranks 1..N-1 in processes of their own, each with its share of the cores. Rank 0 joins the
        process group only once every rank is about to (one that died first cannot hang the join)."""
        parallel = config.parallel_config
        world = self.world_size
        init_method = parallel.distributed_init_method or free_local_init_method()
        threads = max(1, torch.get_num_threads() // world)
        ranks = self._ranks
        for rank in range(1, world):
            ranks.children.append(
                spawn(f"{self.KIND} rank {rank}", run_rank, (type(self), config, rank, init_method), threads, True)
            )
        torch.set_num_threads(threads)
        wait_for(ranks.children, "started")
        init_distributed(
            config.platform.distributed_backend, init_method, 0, world, parallel.distributed_timeout, True,
            parallel.pipeline_parallel_size,
        )  # fmt: skip
        set_watchdog(ranks.dead_rank)
        self.runner = ModelRunner(config)
        wait_for(ranks.children, "ready")
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
        self.runner = ModelRunner(config)
        failed = [
            (r, detail)
            for r, (status, detail) in enumerate(gather_objects(("ready", None)))
            if status != "ready"
        ]
        if failed:
            rank, detail = failed[0]
            raise ConfigError(f"{self.KIND} rank {rank} failed to start: {detail}")
        logger.info("%s: %d ranks launched by torchrun", self.KIND, world)

    @staticmethod
    def send_control(message: object) -> None:
        """Send a plan or a control message (`KEEPALIVE`, None to stop) to the other ranks."""
        raise NotImplementedError

    @staticmethod
    def serve_rank(runner: ModelRunner) -> None:
        """A rank past 0, its part of the model built: run the steps rank 0 sends until it sends None."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Tell the other ranks to exit and wait for them (kill those that cannot be told)."""
        self._finalizer()


def agree_on_kv_cache(runner: ModelRunner) -> None:
    """Every rank takes the smallest block count any rank can afford, so block ids mean the same cache
    slots on all of them."""
    runner.resize_kv_cache(min_over_ranks(runner.num_blocks))


def run_rank(
    kind: type[MultiRankExecutor], config: EngineConfig, rank: int, init_method: str, report: StartReport | None
) -> None:
    """A rank's life past rank 0: join the group, build its part of the model, say whether that worked (on
    `report`, for a spawned rank; over the group for one torchrun started), then run the steps of rank 0's
    executor `kind` until rank 0 stops."""
    parallel = config.parallel_config
    if report is not None:
        report.started()
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
        report.finish(*status)
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
