"""ThreadTuner: the thread count follows measured step times (a machine model stands in for the clock)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from strata import LLM, SamplingParams
from strata.platforms.cpu.thread_tuner import ThreadTuner

DECODE = (1, 1)  # one sequence, one token: a batch-1 decode step


def _run(
    tuner: ThreadTuner, seconds: Callable[[int], float], steps: int, shape: tuple[int, int] = DECODE
) -> list[int]:
    """Feed `steps` steps whose duration depends on the thread count; the counts each step ran with."""
    counts = []
    for _ in range(steps):
        counts.append(tuner.threads)
        tuner.observe(shape, seconds(tuner.threads))
    return counts


def _tuner(max_threads: int = 2) -> ThreadTuner:
    return ThreadTuner(max_threads, window=4, period=20)


QUIET = {1: 1.0, 2: 0.6}.__getitem__  # two threads faster
BUSY_NEIGHBOUR = {1: 1.0, 2: 3.0}.__getitem__  # a descheduled thread stalls every barrier


def test_quiet_machine_keeps_every_thread_and_probes_rarely() -> None:
    tuner = _tuner()
    counts = _run(tuner, QUIET, 200)
    assert tuner.threads == 2
    assert counts.count(1) <= 4 * (200 // 20)  # at most one window per period on the slower count


def test_busy_neighbour_drops_to_one_thread_and_recovers_when_it_leaves() -> None:
    tuner = _tuner()
    counts = _run(tuner, BUSY_NEIGHBOUR, 110)
    assert counts[8:12] == [1, 1, 1, 1]  # the first probe comes after the first window: switched at once
    assert tuner.threads == 1 and counts[-20:].count(1) >= 16
    _run(tuner, QUIET, 100)  # the neighbour is gone: a probe of two threads wins again
    assert tuner.threads == 2


def _probe_lengths(counts: list[int], probed: int) -> list[int]:
    """Lengths of the runs of steps at the `probed` count."""
    lengths, run = [], 0
    for count in [*counts, None]:
        if count == probed:
            run += 1
        elif run:
            lengths.append(run)
            run = 0
    return lengths


def test_probe_ends_after_a_step_if_far_slower_after_a_few_if_clearly_slower() -> None:
    """One thread taking 1.67x as long (compute-bound steps) is seen in the probe's first step, which then
    ends; 1.3x as long in its first `early` steps; one thread only 8% slower could still be noise, so that
    probe runs its whole window."""

    def probe_lengths(seconds: Callable[[int], float]) -> list[int]:
        return _probe_lengths(_run(ThreadTuner(2, window=8, period=40), seconds, 200), probed=1)

    far_slower = probe_lengths(QUIET)
    assert len(far_slower) >= 4 and set(far_slower) == {1}
    clearly_slower = probe_lengths({1: 0.78, 2: 0.6}.__getitem__)
    assert len(clearly_slower) >= 4 and set(clearly_slower) == {3}
    assert set(probe_lengths({1: 0.65, 2: 0.6}.__getitem__)) == {8}


def test_one_noisy_first_step_only_ends_the_probe_early() -> None:
    """A single slow step at the probe's start (noise) ends that probe, keeping the count that ran; the
    next probe, on steady steps, still finds the faster count."""
    tuner = ThreadTuner(2, window=4, period=10)
    _run(tuner, BUSY_NEIGHBOUR, 4)  # the first window, at two threads
    assert tuner.probing and tuner.threads == 1
    tuner.observe(DECODE, 10.0)  # the probe's first step, descheduled
    assert not tuner.probing and tuner.threads == 2
    _run(tuner, BUSY_NEIGHBOUR, 40)
    assert tuner.threads == 1


def test_neighbour_arriving_is_met_within_a_window_not_a_period() -> None:
    """With a period far longer than the run, only the first probe is periodic; a neighbour that makes the
    steps slower than the fastest seen triggers a probe at once."""
    tuner = ThreadTuner(2, window=4, period=10_000)
    quiet = _run(tuner, QUIET, 200)
    assert quiet[20:].count(1) == 0  # after the first probe, no more on a steady machine
    busy = _run(tuner, BUSY_NEIGHBOUR, 20)
    assert busy[:2] == [2, 2] and busy[-10:] == [1] * 10 and tuner.threads == 1


def test_probe_meeting_other_work_is_abandoned() -> None:
    """A probe compares identical steps only: when the shape changes mid-probe it returns to the count
    that ran before, whatever the times say."""
    tuner = _tuner()
    mild_neighbour = {1: 1.0, 2: 1.2}.__getitem__  # a probe of two threads runs its whole window
    _run(tuner, mild_neighbour, 30)  # one thread kept after the first probe; now probing two again
    assert tuner.probing and tuner.threads == 2
    _run(tuner, mild_neighbour, 1, shape=(8, 8))
    assert not tuner.probing and tuner.threads == 1


def test_between_one_and_the_maximum_it_tries_both_directions() -> None:
    tuner = _tuner(max_threads=4)
    best_at_three = {1: 3.0, 2: 2.0, 3: 1.0, 4: 2.0}.__getitem__
    _run(tuner, best_at_three, 400)
    assert tuner.threads == 3


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="period"):
        ThreadTuner(2, window=8, period=10)
    with pytest.raises(ValueError, match="early"):
        ThreadTuner(2, early=0)


def test_engine_tunes_only_when_asked() -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    on = LLM(skip_tokenizer_init=True, adaptive_threads=True)
    off = LLM(skip_tokenizer_init=True, adaptive_threads=False)
    assert (on.engine.runner.thread_policy is not None) == (torch.get_num_threads() > 1)
    assert off.engine.runner.thread_policy is None
    prompt = {"prompt_token_ids": [1, 43, 47]}
    assert (
        on.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        == off.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_each_step_runs_with_the_tuners_count_and_the_process_gets_its_own_back(
    threads: Callable[[int], None],
) -> None:
    """torch's thread count is one per process: another engine, or the caller, may change it between two
    steps. The engine sets its tuner's count for each step and restores the caller's afterwards."""
    threads(2)
    llm = LLM(skip_tokenizer_init=True, adaptive_threads=True)
    tuner = llm.engine.runner.thread_policy
    assert tuner is not None and tuner.max_threads == 2
    seen: list[int] = []
    llm.apply_model(
        lambda model: model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    )
    tuner.threads = 1  # as if a probe had found one thread faster
    params = SamplingParams(temperature=0, max_tokens=3)
    llm.generate({"prompt_token_ids": [1, 43, 47]}, params, use_tqdm=False)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
    tuner.threads = 2
    torch.set_num_threads(3)  # changed between steps by someone else
    seen.clear()
    llm.generate({"prompt_token_ids": [1, 43, 47]}, params, use_tqdm=False)
    assert set(seen) == {2} and torch.get_num_threads() == 3
