"""A pipeline-parallel engine's stages: stage s runs the s-th consecutive share of the decoder layers, on
one rank or sharded over several tensor-parallel ones (rank r is tensor-parallel rank r % T of stage r // T).

Rank 0 (in the first stage, with the scheduler) broadcasts a step's plan to its stage's other ranks; each
rank of a stage runs its layers and sends the plan with the hidden states to its peer of the next stage;
the last stage's first rank sends the logits back to rank 0. Sending does not wait for the next stage, so rank 0 `submit`s up to one step per stage
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
from strata.distributed.communication import broadcast_object, receive_from, send_to
from strata.distributed.parallel_state import pp_rank, pp_world_size, rank, tp_rank, tp_world_size
from strata.worker.model_runner import ModelOutput, ModelRunner, ScheduledWork, StepPlan
from strata.worker.ranks import MultiRankExecutor, RankFailedError


class PipelineParallelExecutor(MultiRankExecutor):
    """The first stage's executor: `submit` starts a step down the pipeline, `collect` returns the logits
    of the oldest step in flight."""

    KIND = "pipeline-parallel"

    def __init__(self, config: EngineConfig) -> None:
        self._in_flight: deque[StepPlan] = deque()
        super().__init__(config)
        # Steps in flight at most: one in each stage.
        self.pipeline_depth = pp_world_size()

    @staticmethod
    def send_control(message: object) -> None:
        """A control message to this stage's other ranks and down the pipeline."""
        if tp_world_size() > 1:
            broadcast_object(message)
        send_to(tp_world_size(), message)

    def submit(self, scheduled: Sequence[ScheduledWork]) -> None:
        """Run this stage's layers on the step (with this stage's other ranks) and pass it on."""
        ranks = self._ranks
        with ranks.lock, ranks.failing_for_good():
            plan = self.runner.plan(scheduled)
            if tp_world_size() > 1:
                broadcast_object(plan)
            hidden_states = self.runner.forward(plan)
            send_to(tp_world_size(), plan, hidden_states)
            ranks.last_message = time.monotonic()
            self._in_flight.append(plan)

    def collect(self) -> ModelOutput:
        """The logits of the oldest step submitted, once the last stage has sent them."""
        ranks = self._ranks
        with ranks.lock, ranks.failing_for_good():
            plan = self._in_flight.popleft()
            _, logits = receive_from(self.world_size - tp_world_size())
            return ModelOutput(logits=logits, sample_rows=plan.sample_rows, prompt_rows=plan.prompt_rows)

    def execute(self, scheduled: Sequence[ScheduledWork]) -> ModelOutput:
        self.submit(scheduled)
        return self.collect()

    def shutdown(self) -> None:
        """Take the logits of the steps still in flight (the stages would wait to send them), then stop."""
        try:
            with suppress(RankFailedError):
                while self._in_flight and self._ranks.running:
                    self.collect()
        finally:
            super().shutdown()
    @staticmethod
    def serve_rank(runner: ModelRunner) -> None:
        """A rank past 0: run each plan on the activations that come with it (the first stage's ranks get
        the plan from rank 0, the others it and the activations from their peer of the previous stage) and
        pass the result on (the last stage's first rank sends the logits to rank 0), until the plan is None.
        Keep-alive messages are passed on too."""
        me, width = rank(), tp_world_size()
        first = pp_rank() == 0
        while True:
            if first:
                message, stage_input = broadcast_object(), None
            else:
                message, stage_input = receive_from(me - width)
            if isinstance(message, StepPlan):
                output = runner.forward(message, stage_input)
                if not runner.last_stage:
                    send_to(me + width, message, output)
                elif tp_rank() == 0:
                    send_to(0, None, output)
            elif not runner.last_stage:
                send_to(me + width, message)
            if message is None:
                return
