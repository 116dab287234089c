"""Sampler behaviour checked against straightforward per-row numpy references."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from strata.engine.sequence import Request
from strata.engine.sequence import Sequence as EngineSequence
from strata.platforms import get_platform
from strata.sample import Sampler, SamplingMetadata, SamplingRow
from strata.sample import sampler as sampler_module
from strata.sample.sampler import _apply_penalties
from strata.sampling_params import SamplingParams

CPU = torch.device("cpu")


def build(
    params: Sequence[SamplingParams],
    vocab_size: int,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    eos: Sequence[int] = (),
) -> SamplingMetadata:
    n = len(params)
    rows = [
        SamplingRow(
            params=p,
            prompt_token_ids=prompts[i] if prompts else [],
            output_token_ids=outputs[i] if outputs else [],
            generator=generators[i] if generators else None,
        )
        for i, p in enumerate(params)
    ]
    assert len(rows) == n
    return SamplingMetadata.build(rows, vocab_size, eos, CPU)


def ref_penalised(
    logits: np.ndarray, p: SamplingParams, prompt: Sequence[int], output: Sequence[int], eos: Sequence[int]
) -> np.ndarray:
    """min_tokens ban, repetition, frequency and presence penalties, one token at a time."""
    x = logits.astype(np.float64).copy()
    if len(output) < p.min_tokens:
        for t in set(eos) | set(p.stop_token_ids):
            x[t] = -np.inf
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def ref_distribution(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Sampling distribution after temperature, top-k, top-p (on the top-k renormalised), min-p."""
    if p.temperature < 1e-5:
        probs = np.zeros_like(x)
        probs[int(np.argmax(x))] = 1.0
        return probs
    z = x / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = sorted(range(len(x)), key=lambda i: (-z[i], i))
    keep = set(order[: p.top_k] if p.top_k > 0 else order)
    mass = sum(probs[i] for i in keep)
    if p.top_p < 1.0:
        kept, before = set(), 0.0
        for i in order:
            if i in keep and before < p.top_p:
                kept.add(i)
                before += probs[i] / mass
        keep = kept
    out = np.array([probs[i] if i in keep else 0.0 for i in range(len(x))])
    if p.min_p > 0.0:
        out[out < p.min_p * out.max()] = 0.0
    return out / out.sum()


def sample_many(logits_row: np.ndarray, p: SamplingParams, n: int, seed: int = 0) -> np.ndarray:
    """n independent samples of one row, drawn as one batch of n identical rows."""
    logits = torch.tensor(logits_row, dtype=torch.float32).expand(n, -1).contiguous()
    md = build([p] * n, len(logits_row))
    out = Sampler(torch.Generator().manual_seed(seed))(logits, md)
    return np.array(out.sampled_token_ids)


LOGITS8 = np.array([2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.5, -1.2])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.6),
        SamplingParams(min_p=0.3),
        SamplingParams(temperature=1.5, top_k=6, top_p=0.8),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.15),
    ],
    ids=["plain", "t0.5", "t2", "top_k3", "top_p0.6", "min_p0.3", "k6_p0.8", "all"],
)
def test_support_and_frequencies_match_reference(params: SamplingParams) -> None:
    n = 20_000
    expected = ref_distribution(LOGITS8, params)
    samples = sample_many(LOGITS8, params, n)
    assert set(samples.tolist()) <= set(np.flatnonzero(expected).tolist())
    freq = np.bincount(samples, minlength=8) / n
    np.testing.assert_allclose(freq, expected, atol=0.015)
    # Every token the reference allows with non-negligible mass does show up.
    assert all(freq[i] > 0 for i in np.flatnonzero(expected > 0.003))


def test_reference_filters_are_not_trivial() -> None:
    # Guards the parametrised test above: each filter must actually remove tokens from LOGITS8.
    full = np.count_nonzero(ref_distribution(LOGITS8, SamplingParams()))
    for p in (SamplingParams(top_k=3), SamplingParams(top_p=0.6), SamplingParams(min_p=0.3)):
        assert 1 < np.count_nonzero(ref_distribution(LOGITS8, p)) < full


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.999}], ids=["top_k_only", "with_top_p"])
def test_top_k_ties_keep_exactly_k_lowest_ids(extra: dict) -> None:
    logits = np.array([0.0, 3.0, 3.0, 3.0, 1.0, 3.0])
    samples = sample_many(logits, SamplingParams(top_k=2, **extra), 4000)
    assert set(samples.tolist()) == {1, 2}


@pytest.mark.parametrize("top_k", [0, 4], ids=["full_sort", "top_k_candidates"])
def test_top_p_ties_at_the_cutoff_go_to_lowest_ids(top_k: int) -> None:
    # Three equal tokens of mass 1/3 each: p = 0.5 needs exactly two of them.
    logits = np.array([-5.0, 4.0, 4.0, 4.0, -5.0, -5.0])
    samples = sample_many(logits, SamplingParams(top_p=0.5, top_k=top_k), 4000)
    assert set(samples.tolist()) == {1, 2}


@pytest.mark.parametrize("prefix", [2, 3, 5])
@pytest.mark.parametrize("top_p", [0.5, 0.6, 0.9])
def test_top_p_prefix_and_full_sort_fallback_match_reference(
    monkeypatch: pytest.MonkeyPatch, prefix: int, top_p: float
) -> None:
    # A short prefix forces both outcomes on the 8-token vocabulary: enough mass, or a full-sort fallback.
    monkeypatch.setattr(sampler_module, "_TOP_P_PREFIX", prefix)
    n = 10_000
    params = SamplingParams(top_p=top_p, temperature=1.3)
    expected = ref_distribution(LOGITS8, params)
    samples = sample_many(LOGITS8, params, n)
    assert set(samples.tolist()) == set(np.flatnonzero(expected).tolist())
    np.testing.assert_allclose(np.bincount(samples, minlength=8) / n, expected, atol=0.02)


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, {2, 3}), (0.7, {2, 3, 4})])
def test_top_p_prefix_cut_inside_a_tie_keeps_lowest_ids(
    monkeypatch: pytest.MonkeyPatch, top_p: float, kept: set[int]
) -> None:
    # The 2-token prefix holds two of four tied tokens (torch.topk does not pick the lowest ids).
    monkeypatch.setattr(sampler_module, "_TOP_P_PREFIX", 2)
    logits = np.array([-5.0, -5.0, 4.0, 4.0, 4.0, 4.0, -5.0, -5.0])
    samples = sample_many(logits, SamplingParams(top_p=top_p), 4000)
    assert set(samples.tolist()) == kept


GROUPS = {
    "plain": SamplingParams(temperature=1.2),
    "top_k": SamplingParams(top_k=3),
    "top_p": SamplingParams(top_p=0.6),
    "top_k_top_p": SamplingParams(top_k=6, top_p=0.8, temperature=0.7),
    "min_p": SamplingParams(min_p=0.3),
    "greedy": SamplingParams(temperature=0.0),
    "wide_top_p": SamplingParams(top_p=0.97, temperature=1.5),
    "top_k2_top_p": SamplingParams(top_k=2, top_p=0.9),
}


@pytest.mark.parametrize(
    "names",
    [
        ("plain", "top_k_top_p"),
        ("top_k", "top_k_top_p", "greedy"),
        ("top_p", "top_k", "top_k_top_p", "min_p"),
        ("greedy", "plain", "min_p"),
        ("wide_top_p", "top_k2_top_p"),
    ],
)
def test_mixed_batch_rows_keep_their_own_distribution(names: tuple[str, ...]) -> None:
    per_group = 8000
    rng = np.random.default_rng(4)
    group_of_row = rng.permutation(np.repeat(np.arange(len(names)), per_group))
    params = [GROUPS[names[g]] for g in group_of_row]
    logits = torch.tensor(LOGITS8, dtype=torch.float32).expand(len(params), -1).contiguous()
    out = Sampler(torch.Generator().manual_seed(1))(logits, build(params, 8))
    samples = np.array(out.sampled_token_ids)
    for g, name in enumerate(names):
        expected = ref_distribution(LOGITS8, GROUPS[name])
        mine = samples[group_of_row == g]
        assert set(mine.tolist()) <= set(np.flatnonzero(expected).tolist()), name
        np.testing.assert_allclose(
            np.bincount(mine, minlength=8) / per_group, expected, atol=0.02, err_msg=name
        )


def test_greedy_is_exact_argmax_lowest_id_on_ties() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(12, 40)).astype(np.float32)
    logits[3, [5, 9, 30]] = 10.0  # three-way tie for the max
    logits[7, :] = 1.0  # all equal
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.0)] * 12
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.tensor(logits).to(dtype)
        out = Sampler()(t, build(params, 40))
        assert out.sampled_token_ids == np.argmax(t.float().numpy(), axis=1).tolist()
    assert out.sampled_token_ids[3] == 5 and out.sampled_token_ids[7] == 0


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.5}, {"min_p": 0.5}], ids=["k1", "k1_p", "k1_minp"])
def test_top_k_one_equals_greedy(extra: dict) -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(16, 30)).astype(np.float32)
    logits[2, [4, 17]] = 9.0  # tie: greedy takes 4
    logits[9, :] = -2.0
    t = torch.tensor(logits)
    greedy = Sampler()(t, build([SamplingParams(temperature=0.0)] * 16, 30)).sampled_token_ids
    params = [SamplingParams(temperature=float(rng.uniform(0.3, 3.0)), top_k=1, **extra) for _ in range(16)]
    for seed in range(3):
        out = Sampler(torch.Generator().manual_seed(seed))(t, build(params, 30))
        assert out.sampled_token_ids == greedy
    assert greedy[2] == 4 and greedy[9] == 0


def random_history(rng: np.random.Generator, vocab: int, length: int) -> list[int]:
    # Small id range so ids repeat and penalties have counts > 1.
    return rng.integers(0, vocab // 2, size=length).tolist()


def test_penalties_match_reference_exactly() -> None:
    rng = np.random.default_rng(2)
    vocab = 24
    params, prompts, outputs = [], [], []
    for i in range(10):
        params.append(
            SamplingParams(
                repetition_penalty=[1.0, 1.3, 0.7][i % 3],
                frequency_penalty=[0.0, 0.5, -1.0, 2.0][i % 4],
                presence_penalty=[0.0, -0.4, 1.5][i % 3],
            )
        )
        prompts.append(random_history(rng, vocab, int(rng.integers(0, 8))))
        outputs.append(random_history(rng, vocab, int(rng.integers(0, 10))))
    logits = rng.normal(scale=3.0, size=(10, vocab))
    md = build(params, vocab, prompts, outputs)
    got = _apply_penalties(torch.tensor(logits, dtype=torch.float32), md).numpy()
    for i in range(10):
        want = ref_penalised(logits[i], params[i], prompts[i], outputs[i], [])
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, logits, atol=1e-3)  # the case actually penalises something


def test_penalties_change_greedy_choice_like_reference() -> None:
    rng = np.random.default_rng(3)
    vocab, batch = 16, 64
    params, prompts, outputs = [], [], []
    for _ in range(batch):
        params.append(
            SamplingParams(
                temperature=0.0,
                repetition_penalty=float(rng.choice([1.0, 1.5, 3.0])),
                frequency_penalty=float(rng.choice([0.0, 0.7])),
                presence_penalty=float(rng.choice([0.0, 1.2])),
            )
        )
        prompts.append(random_history(rng, vocab, 4))
        outputs.append(random_history(rng, vocab, 6))
    logits = rng.normal(scale=2.0, size=(batch, vocab))
    out = Sampler()(torch.tensor(logits, dtype=torch.float32), build(params, vocab, prompts, outputs))
    want = [
        int(np.argmax(ref_penalised(logits[i], params[i], prompts[i], outputs[i], []))) for i in range(batch)
    ]
    assert out.sampled_token_ids == want
    assert want != np.argmax(logits, axis=1).tolist()


def test_stages_are_skipped_when_unused() -> None:
    md = build([SamplingParams(), SamplingParams(temperature=0.0)], 10, [[1, 2]] * 2, [[3]] * 2)
    assert md.repetition_ids is None and md.output_penalty_ids is None
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.temperature is None
    assert md.token_ban is None and md.generators == {}
    md = build(
        [SamplingParams(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)],
        10,
        [[1, 2]] * 2,
        [[3, 4, 3]] * 2,
    )
    assert md.repetition_ids is None
    # Only the penalised row's distinct output ids, indexed into the flattened [B * V] logits.
    assert md.output_penalty_ids.tolist() == [1 * 10 + 3, 1 * 10 + 4]
    np.testing.assert_allclose(md.output_penalty_offsets.tolist(), [0.25 * 2 + 0.5, 0.25 + 0.5])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),  # greedy reads the logits in place, without a copy
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05),
    ],
    ids=["greedy", "penalties", "min-tokens", "random"],
)
def test_caller_logits_are_never_modified(params: SamplingParams) -> None:
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    md = build([params, params], 10, [[1, 2]] * 2, [[3, 3]] * 2, eos=[5])
    sampled = Sampler(torch.Generator().manual_seed(0))(logits, md).sampled_token_ids
    torch.testing.assert_close(logits, before, rtol=0, atol=0)
    if params.temperature == 0.0:
        expected = [np.argmax(ref_penalised(row[:10].numpy(), params, [1, 2], [3, 3], [5])) for row in before]
        assert sampled == expected


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    vocab, eos, stop_id = 10, [9, 8], 7
    logits = np.zeros(vocab)
    logits[[9, 8, 7]] = [12.0, 11.0, 10.0]  # banned ids dominate
    logits[2] = 1.0
    p = SamplingParams(min_tokens=3, stop_token_ids=[stop_id], ignore_eos=ignore_eos, temperature=0.7)
    g = SamplingParams(min_tokens=3, stop_token_ids=[stop_id], ignore_eos=ignore_eos, temperature=0.0)
    batch = 2000
    t = torch.tensor(logits, dtype=torch.float32).expand(batch, -1).contiguous()
    short = [[1, 1]] * batch
    out = Sampler(torch.Generator().manual_seed(0))(
        t, build([p, g] * (batch // 2), vocab, outputs=short, eos=eos)
    )
    assert not {7, 8, 9} & set(out.sampled_token_ids)
    assert out.sampled_token_ids[1] == 2
    # Once min_tokens outputs exist the ban lifts.
    long = [[1, 1, 1]] * batch
    out = Sampler(torch.Generator().manual_seed(0))(
        t, build([p, g] * (batch // 2), vocab, outputs=long, eos=eos)
    )
    assert out.sampled_token_ids[1] == 9
    assert {7, 8, 9} <= set(out.sampled_token_ids)


STEPS = 6
VOCAB = 50


def step_logits(step: int) -> np.ndarray:
    return np.random.default_rng(100 + step).normal(scale=1.5, size=VOCAB).astype(np.float32)


def run_steps(
    target: SamplingParams, position: int, others: list[tuple[SamplingParams, int | None]]
) -> list[int]:
    """Tokens of `target` (seeded) over STEPS steps when placed at `position` among `others`."""
    params = [p for p, _ in others]
    params.insert(position, target)
    seeds = [s for _, s in others]
    seeds.insert(position, target.seed)
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    sampler = Sampler(torch.Generator().manual_seed(len(others) * 7 + position))
    rng = np.random.default_rng(position)
    tokens = []
    for step in range(STEPS):
        rows = [rng.normal(size=VOCAB).astype(np.float32) for _ in params]
        rows[position] = step_logits(step)
        md = build(
            params, VOCAB, prompts=[[1, 2]] * len(params), outputs=[[3]] * len(params), generators=gens
        )
        tokens.append(sampler(torch.tensor(np.stack(rows)), md).sampled_token_ids[position])
    return tokens


def test_seeded_row_is_independent_of_batch() -> None:
    target = SamplingParams(seed=1234, temperature=1.3, top_p=0.95, top_k=40)
    alone = run_steps(target, 0, [])
    others = [
        (SamplingParams(), None),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(seed=1234, temperature=0.9), 1234),
        (SamplingParams(seed=7, min_p=0.1, presence_penalty=1.0), 7),
        (SamplingParams(top_k=3), None),
    ]
    for position in (0, 2, 5):
        assert run_steps(target, position, others) == alone
    assert run_steps(target, 1, others[:2]) == alone
    assert run_steps(target, 1, others[2:3]) == alone
    # A different seed gives a different sequence, so the comparison above is meaningful.
    assert run_steps(SamplingParams(seed=4321, temperature=1.3, top_p=0.95, top_k=40), 0, []) != alone


def test_seeded_row_draws_exactly_one_vocab_sized_sample_per_step() -> None:
    vocab = 37
    gen = torch.Generator().manual_seed(5)
    params = [SamplingParams(seed=5), SamplingParams(), SamplingParams(temperature=0.0)]
    md = build(params, vocab, generators=[gen, None, None])
    Sampler()(torch.randn(3, vocab + 3), md)  # padded logits: draws follow vocab_size
    expected = torch.Generator().manual_seed(5)
    torch.empty(vocab).uniform_(generator=expected)
    assert torch.equal(gen.get_state(), expected.get_state())


def test_unseeded_rows_follow_the_sampler_generator() -> None:
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(0))
    md = build([SamplingParams(temperature=1.0)] * 8, 30)
    a = [Sampler(torch.Generator().manual_seed(11))(logits, md).sampled_token_ids for _ in range(2)]
    b = Sampler(torch.Generator().manual_seed(12))(logits, md).sampled_token_ids
    assert a[0] == a[1] and a[0] != b


def test_padding_columns_are_never_sampled() -> None:
    vocab, pad = 6, 4
    logits = torch.zeros(499, vocab + pad)
    logits[:, vocab:] = 50.0
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=2, top_p=0.9)] * 166
    params.append(SamplingParams())
    md = build(params, vocab)
    out = Sampler(torch.Generator().manual_seed(0))(logits, md)
    assert max(out.sampled_token_ids) < vocab


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="generator"):
        build([SamplingParams(seed=3)], 10)
    with pytest.raises(ValueError, match="vocab_size"):
        build([SamplingParams()], 0)
    with pytest.raises(ValueError, match="rows"):
        build([], 10)
    md = build([SamplingParams(), SamplingParams()], 10)
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(3, 10), md)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(2, 9), md)
    with pytest.raises(ValueError, match="2-D"):
        Sampler()(torch.zeros(2, 10, dtype=torch.long), md)


DEVICES = [
    pytest.param(CPU, id="cpu"),
    pytest.param(
        torch.device("cuda"),
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_on_device_greedy_matches_cpu_and_seeded_rows_are_batch_independent(device: torch.device) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[5] = logits[1]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2),
        SamplingParams(seed=3, top_k=10, top_p=0.9),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.8, frequency_penalty=0.5),
        SamplingParams(min_p=0.1, min_tokens=2),
        SamplingParams(seed=3, top_k=10, top_p=0.9),
    ]

    def run(on: torch.device, picked: list[int]) -> list[int]:
        rows = [
            SamplingRow(
                params[i],
                [1, 2],
                [3],
                None if params[i].seed is None else torch.Generator(device=on).manual_seed(3),
            )
            for i in picked
        ]
        md = SamplingMetadata.build(rows, 50, [0], on)
        return Sampler(torch.Generator(device=on).manual_seed(0))(logits[picked].to(on), md).sampled_token_ids

    on_cpu, on_device = run(CPU, list(range(6))), run(device, list(range(6)))
    assert on_device[0] == on_cpu[0]
    assert on_device[1] == on_device[5] == run(device, [1])[0] == run(device, [4, 2, 1])[2]


@pytest.mark.parametrize(
    ("params", "num_output_tokens", "plain"),
    [
        (SamplingParams(temperature=0), 0, True),
        (SamplingParams(temperature=0, top_k=5, top_p=0.5, seed=3), 0, True),  # no effect on a greedy row
        (SamplingParams(temperature=0, min_tokens=3), 3, True),
        (SamplingParams(temperature=0, min_tokens=3), 2, False),  # EOS and stop tokens still banned
        (SamplingParams(temperature=0.5), 0, False),
        (SamplingParams(temperature=0, logprobs=0), 0, False),
        (SamplingParams(temperature=0, repetition_penalty=1.1), 0, False),
        (SamplingParams(temperature=0, frequency_penalty=0.5), 0, False),
        (SamplingParams(temperature=0, presence_penalty=0.5), 0, False),
    ],
)
def test_plain_greedy_rows_are_those_the_argmax_alone_samples(
    params: SamplingParams, num_output_tokens: int, plain: bool
) -> None:
    assert sampler_module.plain_greedy(params, num_output_tokens) is plain
    # The sampler's own metadata agrees: a plain row is greedy and gets no ban, penalty or logprobs.
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    metadata = build([params], 50, [[5, 6]], [[7] * num_output_tokens], [generator], eos=[0])
    stages = (metadata.token_ban, metadata.repetition_ids, metadata.output_penalty_ids)
    assert (
        metadata.all_greedy and all(stage is None for stage in stages) and metadata.num_logprobs == [None]
    ) is plain
    # So does the count a sequence computes once for the engine's per-step check.
    seq = EngineSequence(Request("r", None, [5, 6], params, 0.0), 0, None, None)
    seq.token_ids.extend([7] * num_output_tokens)
    assert (len(seq.token_ids) >= seq.argmax_only_from) is plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_what_the_sampler_samples_for_plain_greedy_rows(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=generator)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie: the lower id wins
    logits[2, 40] = float("nan")  # a NaN row: its first NaN, as ATen's argmax
    logits = logits.to(dtype)
    params = [SamplingParams(temperature=0, min_tokens=1)] * 5
    metadata = build(params, 300, outputs=[[1]] * 5, eos=[0])
    expected = Sampler()(logits, metadata).sampled_token_ids
    for sampler in (Sampler(), Sampler(argmax=get_platform("cpu").argmax_rows)):
        assert sampler.greedy(logits) == expected
    assert expected[1] == 7 and expected[2] == 40
