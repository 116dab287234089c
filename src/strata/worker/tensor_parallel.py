"""A tensor-parallel engine's ranks: every rank runs every step on its shard of the model, meeting the
others in the sharded layers' collectives; rank 0 broadcasts each step's plan first and keeps the logits."""

from __future__ import annotations

from collections.abc import Sequence

from strata.distributed.communication import broadcast_object
from strata.worker.model_runner import ModelOutput, ModelRunner, ScheduledWork, StepPlan
from strata.worker.ranks import MultiRankExecutor


class TensorParallelExecutor(MultiRankExecutor):
    """Rank 0's executor of a tensor-parallel engine."""

    KIND = "tensor-parallel"

    @staticmethod
    def send_control(message: object) -> None:
        broadcast_object(message)

    def execute(self, scheduled: Sequence[ScheduledWork]) -> ModelOutput:
        ranks = self._ranks
        with ranks.lock, ranks.failing_for_good():
            plan = self.runner.plan(scheduled)
            ranks.send(plan)
            return self.runner.run(plan)

    @staticmethod
    def serve_rank(runner: ModelRunner) -> None:
        while (plan := broadcast_object()) is not None:
            if isinstance(plan, StepPlan):  # else a keep-alive message
                runner.run(plan)
