"""The reused host buffers a step's inputs are staged in (`model_runner.StagingBuffer`)."""

from __future__ import annotations

import pytest
import torch

from strata.worker import model_runner
from strata.worker.model_runner import StagingBuffer


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_fill_returns_the_values_in_the_shape_asked_for(dtype: torch.dtype) -> None:
    buffer = StagingBuffer(dtype)
    first = buffer.fill([3, 1, 4, 1, 5, 9], (2, 3))
    assert first.dtype == dtype and first.is_inference()
    assert first.tolist() == [[3, 1, 4], [1, 5, 9]]
    # Fewer values next: only they are visible, nothing of the longer fill before.
    assert buffer.fill([2, 7]).tolist() == [2, 7]
    # More values than the buffer holds: it grows, and the values are all there.
    many = list(range(1000))
    assert buffer.fill(many, (1, 1000)).tolist() == [many]
    assert buffer.fill([8]).tolist() == [8]


def test_a_shape_filled_again_is_the_same_view_with_the_new_values() -> None:
    buffer = StagingBuffer(torch.int64)
    step_one = buffer.fill([10, 11], (1, 2))
    step_two = buffer.fill([20, 21], (1, 2))
    assert step_two is step_one
    assert step_two.tolist() == [[20, 21]]


def test_kept_views_are_bounded() -> None:
    buffer = StagingBuffer(torch.int64)
    for count in range(1, 3 * model_runner._MAX_STAGED_VIEWS):
        assert buffer.fill(list(range(count))).tolist() == list(range(count))
        assert len(buffer.views) <= model_runner._MAX_STAGED_VIEWS
