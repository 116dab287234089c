"""Admission is fair between requests: a request of many sequences cannot hold back another's first token,
and what each request gets does not change."""

from __future__ import annotations

from strata import LLM, SamplingParams

from stories260k import PROMPT

HUGE = SamplingParams(n=24, temperature=0, max_tokens=40, ignore_eos=True)
SMALL = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(llm: LLM, small_after_steps: int) -> tuple[int, dict[str, list[list[int]]]]:
    """Steps until the small request's first token, and every request's tokens at the end."""
    engine = llm.engine
    engine.add_request(PROMPT, HUGE, "huge")
    for _ in range(small_after_steps):
        engine.step()
    engine.add_request("Lily had a dog", SMALL, "small")
    small = engine.requests["small"]
    steps_to_first_token = 0
    while small.first_token_time is None:
        engine.step()
        steps_to_first_token += 1
    tokens: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = [c.token_ids for c in output.outputs]
    return steps_to_first_token, tokens


def test_a_small_request_gets_its_first_token_beside_a_full_batch_of_another() -> None:
    llm = LLM(max_num_seqs=8)  # the huge request alone fills the batch three times over
    steps, tokens = _run(llm, small_after_steps=3)
    assert steps == 1
    alone = LLM(max_num_seqs=8)
    assert tokens["small"] == [
        o.token_ids for o in alone.generate("Lily had a dog", SMALL, use_tqdm=False)[0].outputs
    ]
    assert tokens["huge"] == [o.token_ids for o in alone.generate(PROMPT, HUGE, use_tqdm=False)[0].outputs]
    stats = llm.stats()
    assert stats["num_preemptions"] >= 1  # the huge request gave one of its slots up
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0


def test_waiting_requests_are_admitted_by_fewest_running() -> None:
    """Two requests waiting together share the batch instead of the first taking all of it."""
    llm = LLM(max_num_seqs=4)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=8, temperature=0, max_tokens=4, ignore_eos=True), "a")
    engine.add_request(PROMPT, SamplingParams(n=8, temperature=0, max_tokens=4, ignore_eos=True), "b")
    engine.step()
    running = [seq.request.request_id for seq in engine.scheduler.running]
    assert sorted(running) == ["a", "a", "b", "b"]
    while engine.has_unfinished_requests():
        engine.step()
