"""The life of the processes an engine spawns on this machine (the ranks of a model-parallel engine, the
replicas of a data-parallel one), written once for both.

A child is spawned with its share of the cores and a pipe back to its parent. Until it is ready, a
thread of the child sends heartbeats on that pipe, and the child's target reports "started" (about to
meet the others: rank 0 waits for every rank's before it joins the process group itself), then "ready"
or "error". The parent's waits all have deadlines and watch the child: one that exits, or falls silent
(suspended, hung), before it is ready fails the start within seconds, with an error naming it, its exit
code and the last lines of its stderr, which the parent reads through a pipe (the spawn bootstrap, which
fails before any of our code runs in the child, writes there too). Stopping one joins it with a
deadline, then kills it.

This module imports no torch at its top: a child unpickles it first and starts its heartbeat before it
imports the rest (the target and its arguments travel pickled, unpickled once the heartbeat runs).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from strata import envs

logger = logging.getLogger("strata.worker.processes")

# How often a parent looks at its starting children.
_POLL_SECONDS = 0.1
# Lines of a child's stderr an error quotes.
_STDERR_LINES = 20
# Seconds a child that was told to stop (or died) is given to exit before it is killed.
EXIT_SECONDS = 10.0
# What multiprocessing says when a spawned child starts processes while it imports the parent's script.
_BOOTSTRAP_ERROR = "bootstrapping phase"
_GUARD_ADVICE = (
    "the spawned process re-ran your script while importing it: guard the code that creates the engine "
    'with `if __name__ == "__main__":` (processes are started with multiprocessing\'s "spawn" method)'
)
# Held while fd 2 points at a child's stderr pipe, and by the threads that forward those pipes to it.
_stderr_lock = threading.Lock()


class ProcessStartError(RuntimeError):
    """A spawned rank or replica died or hung while starting: the engine cannot start."""


class ProcessBuildError(ProcessStartError, ValueError):
    """A spawned rank or replica could not build its part of the engine, and said why: most often the
    configuration or the model's files, a user's error, so a ValueError like the engine's own ConfigError
    (this module imports no `strata.config`, which imports torch)."""


class StderrTail:
    """A child's stderr: each line forwarded to this process's stderr, the last ones kept for errors."""

    def __init__(self, read_fd: int) -> None:
        self.lines: deque[str] = deque(maxlen=_STDERR_LINES)
        self._thread = threading.Thread(target=self._forward, args=(read_fd,), name="strata-stderr", daemon=True)
        self._thread.start()

    def _forward(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for line in pipe:
                with _stderr_lock:
                    os.write(2, line)
                self.lines.append(line.decode(errors="replace").rstrip())

    def text(self) -> str:
        """The last lines, once the child has closed its stderr (or after a second, if its own children
        still hold it)."""
        self._thread.join(timeout=1.0)
        return "\n".join(self.lines)


class Spawned:
    """The parent's handle on one child: its process, its end of the pipe, its stderr, how far it got."""

    def __init__(self, name: str, process: BaseProcess, conn: Connection, stderr: StderrTail) -> None:
        self.name = name  # how errors name it: "tensor-parallel rank 1", "data-parallel replica 0"
        self.process = process
        self.conn = conn
        self.stderr = stderr
        self.stage = "spawned"  # then "started", then "ready"
        self.detail: Any = None  # what it sent with "ready"
        self.last_sign_of_life = time.monotonic()
        self.heard_from = False

    def _check(self, timeout: StartTimeouts) -> None:
        """Read what the child sent; an error if it failed, exited or fell silent."""
        while self.stage != "ready" and self.conn.poll():
            try:
                kind, detail = self.conn.recv()
            except (EOFError, OSError):
                break  # it exited: reported below
            self.last_sign_of_life, self.heard_from = time.monotonic(), True
            if kind == "error":
                raise ProcessBuildError(self.exit_report("failed to start", detail))
            if kind in ("started", "ready"):
                self.stage, self.detail = kind, detail
        if self.stage == "ready":
            return
        if not self.process.is_alive():
            raise ProcessStartError(self.exit_report("exited while starting"))
        silence = time.monotonic() - self.last_sign_of_life
        # Until its first heartbeat the child imports the parent's script (its bootstrap): more time for that.
        allowed = timeout.heartbeat if self.heard_from else timeout.first_heartbeat
        if silence > allowed:
            raise ProcessStartError(
                f"{self.name} stopped answering while starting: no heartbeat for {silence:.0f} s "
                f"(suspended or hung; STRATA_HEARTBEAT_TIMEOUT={timeout.heartbeat:g})"
            )

    def exit_report(self, what: str, detail: str = "") -> str:
        """`<name> <what> (exit code c): <detail>`, the main-module advice when the spawn bootstrap failed,
        and the last lines of its stderr."""
        self.process.join(timeout=EXIT_SECONDS)
        tail = self.stderr.text()
        report = f"{self.name} {what} (exit code {self.process.exitcode})"
        if _BOOTSTRAP_ERROR in tail:
            detail = _GUARD_ADVICE
        report += f": {detail.rstrip()}" if detail else ""
        return report + (f"; its stderr ended with:\n{tail}" if tail else "; it wrote nothing to stderr")


class StartTimeouts:
    """How long a starting child may take: to become ready, and to stay silent (from envs)."""

    def __init__(self) -> None:
        self.ready = envs.process_start_timeout()
        self.heartbeat = envs.heartbeat_timeout()
        self.first_heartbeat = 4 * self.heartbeat


def spawn(name: str, target: Callable[..., None], args: tuple[Any, ...], threads: int, daemon: bool) -> Spawned:
    """Start `target(*args, report)` in a spawned process with `threads` torch threads; `report` is the
    child's `StartReport`. The child's stderr comes to us through a pipe (forwarded, its tail kept)."""
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    payload = pickle.dumps((target, args))
    heartbeat = StartTimeouts().heartbeat
    process = context.Process(
        target=_child_main, args=(child_conn, payload, threads, heartbeat), name=name.replace(" ", "-"),
        daemon=daemon,
    )  # fmt: skip
    # Started now, not inside the window below, so the tracker does not keep the child's stderr pipe.
    resource_tracker.ensure_running()
    read_fd, write_fd = os.pipe()
    with _stderr_lock:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(write_fd, 2)
        try:
            process.start()
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(write_fd)
    child_conn.close()  # so the parent sees the pipe close when the child dies
    return Spawned(name, process, conn, StderrTail(read_fd))


def wait_for(children: Iterable[Spawned], stage: str) -> None:
    """Until every child has reached `stage` ("started" or "ready"); the first that failed, exited or
    hung, or the start deadline passing, is a ProcessStartError naming it."""
    timeout = StartTimeouts()
    deadline = time.monotonic() + timeout.ready
    order = ("spawned", "started", "ready")
    pending = [child for child in children if order.index(child.stage) < order.index(stage)]
    while pending:
        for child in list(pending):
            child._check(timeout)
            if order.index(child.stage) >= order.index(stage):
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            names = ", ".join(child.name for child in pending)
            raise ProcessStartError(
                f"{names} did not start within {timeout.ready:g} s (STRATA_PROCESS_START_TIMEOUT)"
            )
        if pending:
            time.sleep(_POLL_SECONDS)


def stop(children: Iterable[Spawned], grace: float = EXIT_SECONDS) -> None:
    """Wait up to `grace` seconds for each child to exit (they were told to stop, or died), killing those
    that do not (at once after a failed start, `grace` 0: they are of no use)."""
    for child in children:
        child.process.join(timeout=grace)
        if child.process.is_alive():
            if grace > 0:
                logger.warning("%s did not stop; killing it", child.name)
            child.process.kill()
            child.process.join()


# -- the child's side ----------------------------------------------------------------------------------
class StartReport:
    """A child's messages to its parent while it starts; heartbeats from a thread until it is ready (or
    failed). After that, `conn` is the target's own (a replica's command pipe)."""

    def __init__(self, conn: Connection, heartbeat: float) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._beats = threading.Thread(
            target=self._beat, args=(heartbeat / 5,), name="strata-heartbeat", daemon=True
        )
        self._beats.start()

    def _beat(self, interval: float) -> None:
        while True:
            self._send("alive", None)
            if self._done.wait(interval):
                return

    def _send(self, kind: str, detail: Any) -> None:
        with self._lock:
            self.conn.send((kind, detail))

    def started(self) -> None:
        """About to meet the other processes (join the process group): the parent may go on too."""
        self._send("started", None)

    def finish(self, kind: str, detail: Any) -> None:
        """"ready" (with what the parent should know) or "error" (with why); the heartbeats stop."""
        self._done.set()
        self._beats.join()
        self._send(kind, detail)


def _child_main(conn: Connection, payload: bytes, threads: int, heartbeat: float) -> None:
    """A spawned child: heartbeats first, then the (heavy) imports of its target, then the target."""
    report = StartReport(conn, heartbeat)
    target, args = pickle.loads(payload)
    import torch

    torch.set_num_threads(threads)
    target(*args, report)
