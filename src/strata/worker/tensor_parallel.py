"""A tensor-parallel engine's ranks: every rank runs every step on its shard of the model, meeting the
others in the sharded layers' collectives; rank 0 broadcasts each step's plan first and keeps the logits."""

from __future__ import annotations

import time
from collections.abc import Sequence

from strata.distributed.communication import broadcast_object
from strata.worker.model_runner import ModelOutput, ModelRunner, ScheduledWork, StepPlan
from strata.worker.ranks import MultiRankRunner


class TensorParallelRunner(MultiRankRunner):
    """Rank 0's runner of a tensor-parallel engine."""

    KIND = "tensor-parallel"

    def _send(self, message: object) -> None:
        broadcast_object(message)
        self._last_message = time.monotonic()

    def execute(self, scheduled: Sequence[ScheduledWork]) -> ModelOutput:
        with self._lock, self._failing_for_good():
            plan = self.plan(scheduled)
            self._send(plan)
            return self.run(plan)

    @staticmethod
    def serve_rank(runner: ModelRunner) -> None:
        while (plan := broadcast_object()) is not None:
            if isinstance(plan, StepPlan):  # else a keep-alive message
                runner.run(plan)
