"""A pipeline-parallel engine's stages: rank s runs the s-th consecutive share of the decoder layers.

Rank 0 (the first stage, with the scheduler) runs its layers on a step's plan and sends the plan with
its hidden states to rank 1, which runs its layers and passes them on; the last stage sends the logits
back to rank 0. Sending does not wait for the next stage, so rank 0 `submit`s up to one step per stage
before it `collect`s the oldest one's logits: while a later stage runs step k, the earlier ones already
run steps k + 1, ... (the engine keeps a sequence in one step in flight at a time). Messages go through
`send_to`/`receive_from`: shared-memory rings between ranks of one machine, the process group's
point-to-point messages across machines.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from contextlib import suppress

from strata.config import EngineConfig
from strata.distributed.communication import receive_from, send_to
from strata.distributed.parallel_state import pp_rank, pp_world_size
from strata.worker.model_runner import ModelOutput, ModelRunner, ScheduledWork, StepPlan
from strata.worker.tensor_parallel import RankFailedError, TensorParallelRunner


class PipelineParallelRunner(TensorParallelRunner):
    """The first stage's runner: `submit` starts a step down the pipeline, `collect` returns the logits of
    the oldest step in flight."""

    KIND = "pipeline-parallel"

    def __init__(self, config: EngineConfig) -> None:
        self._in_flight: deque[StepPlan] = deque()
        super().__init__(config)
        # Steps in flight at most: one in each stage.
        self.pipeline_depth = self.world_size

    def _send(self, message: object) -> None:
        send_to(1, message)
        self._last_message = time.monotonic()

    def submit(self, scheduled: Sequence[ScheduledWork]) -> None:
        """Run this stage's layers on the step and pass it to the next stage."""
        with self._lock, self._failing_for_good():
            plan = self.plan(scheduled)
            hidden_states = self.forward(plan)
            send_to(1, plan, hidden_states)
            self._last_message = time.monotonic()
            self._in_flight.append(plan)

    def collect(self) -> ModelOutput:
        """The logits of the oldest step submitted, once the last stage has sent them."""
        with self._lock, self._failing_for_good():
            plan = self._in_flight.popleft()
            _, logits = receive_from(self.world_size - 1)
            return ModelOutput(logits=logits, sample_rows=plan.sample_rows, prompt_rows=plan.prompt_rows)

    def execute(self, scheduled: Sequence[ScheduledWork]) -> ModelOutput:
        self.submit(scheduled)
        return self.collect()

    def shutdown(self) -> None:
        """Take the logits of the steps still in flight (the stages would wait to send them), then stop."""
        try:
            with suppress(RankFailedError):
                while self._in_flight and self._running:
                    self.collect()
        finally:
            super().shutdown()


def run_stage(runner: ModelRunner) -> None:
    """A stage past the first: run each plan the previous stage sends on the activations it sends with it,
    and pass the result on (the last stage sends its logits to rank 0), until the previous stage sends
    None. Keep-alive messages are passed on too."""
    rank, world = pp_rank(), pp_world_size()
    following = (rank + 1) % world
    while True:
        message, stage_input = receive_from(rank - 1)
        if isinstance(message, StepPlan):
            output = runner.forward(message, stage_input)
            send_to(following, None if runner.last_stage else message, output)
        elif not runner.last_stage:
            send_to(following, message)
        if message is None:
            return
