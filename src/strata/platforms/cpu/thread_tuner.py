"""Chooses the CPU thread count from the engine's own step times, and keeps checking it.

Every parallel op ends at a barrier, so a step is as slow as its slowest thread. When another process
takes one of the cores, the thread sharing that core is descheduled for whole time slices and every
barrier waits for it: two threads on a two-core machine with a busy neighbour decode several times slower
than one thread would. The right count therefore depends on what else runs on the machine, and changes.

`ThreadTuner` watches runs of identical steps (same number of sequences and tokens, so the same work).
It probes after the first `window` of them, every `period` steps after that, and at once when the steps
get slower by more than `slowdown` than the fastest they ran at this count (a neighbour arriving): it takes
the median time of the last `window` such steps as the baseline, runs the next `window` identical steps with
one thread fewer (or, below the configured count, one more), and keeps whichever count was faster by more
than the noise margin. A probe that meets a different step shape is abandoned, and so is one whose first
step alone runs more than `first_loss` slower than the baseline, or whose first `early` steps run more than
`early_loss` slower: the count it tries is clearly worse, and finishing the window would only add slow
steps. That matters where a step's work is compute-bound (a large batch on few cores, where one thread fewer
is much slower), and where the machine's own noise or steps slowing as contexts grow set off the
`slowdown` trigger: ending early keeps such false alarms cheap (a single slow step from noise at most ends a
probe early, which keeps the count that ran). On a quiet machine a probe costs `early` to `window` slower
steps every `period`; a neighbour is still met within a window.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from strata.platforms.interface import ThreadPolicy

logger = logging.getLogger("strata.platforms.cpu")

StepShape = tuple[int, int]  # (sequences, tokens) of one step


def _median(values: deque[float]) -> float:
    """`statistics.median`, without its generality: called every step, right after the weights have
    streamed through the caches, where each line of code it runs is a cache miss."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


class ThreadTuner(ThreadPolicy):
    """Feed it every step's shape and seconds (`observe`); `threads` is the count the next step should run
    with. `enter` applies it for one step and `exit` restores the process's count: torch's thread count is
    one per process, and another engine or the user may set it between two steps."""

    def __init__(
        self,
        max_threads: int,
        window: int = 16,
        period: int = 2048,
        margin: float = 0.05,
        slowdown: float = 0.25,
        early: int = 3,
        early_loss: float = 0.25,
        first_loss: float = 0.5,
    ) -> None:
        if max_threads < 1 or window < 1 or period <= 2 * window or early < 1:
            raise ValueError("need max_threads >= 1, window >= 1, early >= 1 and period > 2 * window")
        self.max_threads = max_threads
        self.threads = max_threads
        self.window = window
        self.period = period
        self.margin = margin
        self.slowdown = slowdown
        self.early = early
        self.early_loss = early_loss
        self.first_loss = first_loss
        self._shape: StepShape | None = None
        # The current run of identical steps at `self.threads`: its last `window` times, all that is read.
        self._times: deque[float] = deque(maxlen=window)
        self._since_probe = period - window  # the first probe follows the first full window
        self._baseline: float | None = None  # median seconds at `_return_to` while probing
        self._fastest: float | None = None  # fastest window median at this count and step shape
        self._return_to = max_threads
        self._probe_fewer = False

    def enter(self) -> Any:
        """Switch to this step's count; returns the count to restore, or None where they are the same."""
        outer = torch.get_num_threads()
        if self.threads == outer:
            return None
        torch.set_num_threads(self.threads)
        return outer

    def exit(self, token: Any) -> None:
        if token is not None:
            torch.set_num_threads(token)

    @property
    def probing(self) -> bool:
        return self._baseline is not None

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape != self._shape:
            self._shape, self._fastest = shape, None
            self._times.clear()
            if self.probing:  # other work: the probe's times would not compare
                self._switch(self._return_to)
                self._baseline = None
        self._times.append(seconds)
        self._since_probe += 1
        if self.probing and len(self._times) < self.window:
            assert self._baseline is not None
            steps = len(self._times)
            if (steps == 1 and seconds > self._baseline * (1 + self.first_loss)) or (
                steps == self.early and _median(self._times) > self._baseline * (1 + self.early_loss)
            ):
                self._end_probe(keep=False)  # clearly slower already
            return
        if len(self._times) < self.window:
            return
        recent = _median(self._times)
        if self.probing:
            assert self._baseline is not None
            if recent > self._baseline * (1 - self.margin):
                self._end_probe(keep=False)  # not clearly faster: back to what ran before
            else:
                # Debug, not info: it may change every `period` steps, and would break into streamed text.
                logger.debug("%d threads run this step %.0f%% faster: keeping them", self.threads,
                             100 * (1 - recent / self._baseline))  # fmt: skip
                self._end_probe(keep=True)
            return
        self._fastest = recent if self._fastest is None else min(self._fastest, recent)
        slowed = recent > self._fastest * (1 + self.slowdown)
        if (self._since_probe >= self.period or slowed) and self.max_threads > 1:
            self._baseline, self._return_to = recent, self.threads
            self._switch(self._candidate())
            self._times.clear()

    def _end_probe(self, keep: bool) -> None:
        """Close the probe: keep the count it tried or go back to the one before, and start a new period."""
        if not keep:
            self._switch(self._return_to)
        self._baseline, self._since_probe = None, 0
        self._times.clear()

    def _candidate(self) -> int:
        """The count to probe: one fewer from the configured count, one more from a single thread, and in
        between alternately one fewer and one more."""
        if self.threads == self.max_threads:
            return self.threads - 1
        if self.threads == 1:
            return 2
        self._probe_fewer = not self._probe_fewer
        return self.threads - 1 if self._probe_fewer else self.threads + 1

    def _switch(self, threads: int) -> None:
        if threads != self.threads:
            self.threads, self._fastest = threads, None
