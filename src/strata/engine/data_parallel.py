"""`DataParallelEngine`: D replicas of one engine behind one server, each an `LLMEngine` in its own process.

A load one engine cannot serve is split over replicas that share nothing: each is built from the same
`EngineConfig` in a process spawned for it (with its share of the cores; a tensor-parallel replica spawns
its own ranks from there) and runs the engine loop on the commands the server sends it over a
`multiprocessing` pipe: adds, aborts, stop in; each pass's outputs, failures and stats out. The server
tokenizes and validates prompts once, in its own process, and sends each request to the live replica with
the fewest unfinished requests. A replica that dies ends its own requests with an error naming it; the
others go on serving, and only when none is left does the engine fail (the server then exits non-zero).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from strata.config import EngineConfig
from strata.engine.engine_client import EngineClient
from strata.engine.engine_loop import Command, EngineDeadError, run_engine_loop
from strata.engine.llm_engine import LLMEngine, load_tokenizer
from strata.engine.prompts import PromptChecker, PromptType
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams
from strata.worker.processes import EXIT_SECONDS, Spawned, StartReport, spawn, stop, wait_for

logger = logging.getLogger("strata.data_parallel")


class ReplicaFailedError(RuntimeError):
    """Every data-parallel replica died: nothing is left to serve."""


@dataclass(eq=False)
class _Replica:
    """The server's handle on one replica; `requests` are those it was sent that are still being read."""

    index: int
    child: Spawned
    stats: dict[str, Any] = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)
    death: str | None = None  # why it died; None while it lives
    reader: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self.death is None

    @property
    def process(self) -> BaseProcess:
        return self.child.process

    @property
    def conn(self) -> Connection:
        return self.child.conn


class DataParallelEngine(EngineClient):
    """`config.parallel_config.data_parallel_size` replicas of the engine `config` describes, each in a
    process of its own, behind the interface the server uses (`EngineClient`)."""

    def __init__(self, config: EngineConfig) -> None:
        model_config = config.model_config
        tokenizer = None if model_config.skip_tokenizer_init else load_tokenizer(model_config.tokenizer)
        max_model_len: int = model_config.max_model_len  # type: ignore[assignment]
        super().__init__(tokenizer, max_model_len, model_config.vocab_size)
        self._prompts = PromptChecker(tokenizer, model_config.vocab_size, max_model_len)
        self._owners: dict[str, _Replica] = {}
        self._turn = itertools.count()
        self._started = self._stopping = False
        size = config.parallel_config.data_parallel_size
        # Each replica takes its share of the cores (and divides it among its tensor-parallel ranks).
        threads = max(1, torch.get_num_threads() // size)
        self._replicas: list[_Replica] = []
        # multiprocessing joins every non-daemon child at exit: a server that ends without shutting the
        # engine down (it failed to bind its port) closes the pipes first, so the replicas stop.
        atexit.register(self._close_pipes)
        try:
            for index in range(size):
                # Not a daemon: a tensor-parallel replica spawns its ranks, which daemons may not.
                child = spawn(f"data-parallel replica {index}", run_replica, (config,), threads, False)
                self._replicas.append(_Replica(index, child))
            wait_for([replica.child for replica in self._replicas], "ready")
        except BaseException:
            stop([replica.child for replica in self._replicas], grace=0)
            self._close_pipes()
            raise
        for replica in self._replicas:
            replica.stats = replica.child.detail
        logger.info("data parallel: %d replicas, %d threads each", size, threads)

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            raise RuntimeError("the data-parallel engine is already running")
        self._started = True
        self._loop = asyncio.get_running_loop()
        for replica in self._replicas:
            replica.reader = threading.Thread(
                target=self._read, args=(replica,), name=f"strata-replica-{replica.index}-reader", daemon=True
            )
            replica.reader.start()

    async def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for replica in self._replicas:
            if replica.alive:
                self._send(replica, ("stop", None))
        await asyncio.to_thread(self._stop_processes)
        self._fail_unstarted()

    def _stop_processes(self) -> None:
        """Wait for the replicas (and the threads reading them) to end; kill those that do not."""
        stop([replica.child for replica in self._replicas])
        for replica in self._replicas:
            if replica.reader is not None:
                replica.reader.join()
        self._close_pipes()

    def _close_pipes(self) -> None:
        """A replica whose pipe closes stops, as if told to."""
        for replica in self._replicas:
            replica.conn.close()

    @property
    def is_running(self) -> bool:
        return self._started and not self._stopping and any(replica.alive for replica in self._replicas)

    @property
    def stats(self) -> dict[str, Any]:
        """The replicas' counters added up, and each replica's own under "replicas" (with whether it is
        alive and its process id)."""
        replicas = [
            {**replica.stats, "alive": replica.alive, "pid": replica.process.pid}
            for replica in self._replicas
        ]
        return {**total_stats([replica.stats for replica in self._replicas]), "replicas": replicas}

    # -- requests -------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self._prompts.tokenize(prompt)

    def _submit(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> None:
        """To the live replica with the fewest unfinished requests; ties go round in turn."""
        first = next(self._turn) % len(self._replicas)
        order = self._replicas[first:] + self._replicas[:first]
        live = [replica for replica in order if replica.alive]
        if not live:
            raise EngineDeadError("every data-parallel replica has died")
        replica = min(live, key=lambda candidate: len(candidate.requests))
        replica.requests.add(request_id)
        self._owners[request_id] = replica
        self._send(replica, ("add", (request_id, prompt, params)))

    def _release(self, request_id: str, finished: bool) -> None:
        replica = self._owners.pop(request_id, None)
        if replica is None:
            return
        replica.requests.discard(request_id)
        if not finished and replica.alive:
            self._send(replica, ("abort", request_id))

    @staticmethod
    def _send(replica: _Replica, command: Command) -> None:
        """On the event loop. A replica that just died cannot be told; its reader reports the death."""
        try:
            replica.conn.send(command)
        except OSError:
            logger.debug("data-parallel replica %d is gone; dropped %r", replica.index, command[0])

    # -- what replicas send back ----------------------------------------------------------------------
    def _read(self, replica: _Replica) -> None:
        """A replica's reader thread: its outputs to the event loop, until its pipe closes."""
        reason = None
        while True:
            try:
                kind, *payload = replica.conn.recv()
            except (EOFError, OSError):
                break
            if kind == "failed":  # its engine broke for good (one of its tensor-parallel ranks died)
                reason = payload[0]
                break
            outputs, failures, stats = payload
            self.call_soon_threadsafe(self._on_step, replica, outputs, failures, stats)
        if self._stopping:
            return
        replica.process.join(timeout=EXIT_SECONDS)
        death = f"data-parallel replica {replica.index} died (exit code {replica.process.exitcode})"
        self.call_soon_threadsafe(self._on_death, replica, f"{death}: {reason}" if reason else death)

    def _on_step(
        self,
        replica: _Replica,
        outputs: list[RequestOutput],
        failures: dict[str, BaseException],
        stats: dict[str, Any],
    ) -> None:
        replica.stats = stats
        self._deliver(outputs, failures)

    def _on_death(self, replica: _Replica, death: str) -> None:
        """On the event loop: the replica's requests fail naming it; new ones go to the others. With none
        left, the engine has failed."""
        logger.error("%s; failing its %d requests", death, len(replica.requests))
        replica.death = death
        replica.stats = {**replica.stats, "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self._deliver([], {request_id: EngineDeadError(death) for request_id in replica.requests})
        if not any(candidate.alive for candidate in self._replicas):
            deaths = "; ".join(candidate.death or "" for candidate in self._replicas)
            self._failed(ReplicaFailedError(f"every data-parallel replica died: {deaths}"))


def total_stats(replica_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's worth of counters from the replicas': sums, except the largest batch (a maximum) and
    the KV-cache usage (the fraction of all the replicas' blocks in use)."""
    totals: dict[str, Any] = {}
    for stats in replica_stats:
        for key, value in stats.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key.startswith("max_"):
                totals[key] = max(totals.get(key, value), value)
            else:
                totals[key] = totals.get(key, 0) + value
    blocks = totals.get("num_kv_blocks", 0)
    used = sum(stats.get("kv_cache_usage", 0.0) * stats.get("num_kv_blocks", 0) for stats in replica_stats)
    totals["kv_cache_usage"] = used / blocks if blocks else 0.0
    return totals


# -- the replica's process ----------------------------------------------------------------------------
def run_replica(config: EngineConfig, report: StartReport) -> None:
    """A replica's life: build the engine, say whether that worked, then run the engine loop on what the
    server sends until it says stop or goes away. Ctrl-C reaches the whole process group: the server alone
    decides when replicas stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_the_server, name="strata-replica-watchdog", daemon=True).start()
    conn = report.conn
    try:
        engine = LLMEngine(config)
    except Exception as exc:
        report.finish("error", f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from exc
    report.finish("ready", engine.stats())

    def deliver(outputs: list[RequestOutput], failures: dict[str, BaseException]) -> None:
        portable = {request_id: _portable(exc) for request_id, exc in failures.items()}
        conn.send(("step", outputs, portable, engine.stats()))

    try:
        failure = run_engine_loop(engine, lambda block: _receive(conn, block), deliver)
    finally:
        engine.shutdown()
    if failure is not None:
        conn.send(("failed", str(failure)))
        raise SystemExit(1)


def _exit_with_the_server() -> None:
    """A server that dies first (killed while its replicas still build their engines, say) takes its
    replicas, and their tensor-parallel ranks, with it."""
    parent = multiprocessing.parent_process()
    assert parent is not None
    parent.join()
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(1)


def _receive(conn: Connection, block: bool) -> list[Command]:
    """The commands that arrived (waiting for one when `block`); the server gone means stop."""
    commands: list[Command] = []
    try:
        if block:
            commands.append(conn.recv())
        while conn.poll():
            commands.append(conn.recv())
    except (EOFError, OSError):
        commands.append(("stop", None))
    return commands


def _portable(exc: BaseException) -> BaseException:
    """A request's failure as one of the classes the server tells apart (a refused request, a dead engine,
    anything else), which always survives pickling, unlike exceptions with their own constructors."""
    if isinstance(exc, EngineDeadError):
        return EngineDeadError(str(exc))
    if isinstance(exc, ValueError):
        return ValueError(str(exc))
    return RuntimeError(f"{type(exc).__name__}: {exc}")
