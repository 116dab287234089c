"""Weights and KV caches in transparent huge pages: same values and sharing as before the move, one 2 MiB
aligned arena, and (where the kernel offers THP) a mapping the kernel marks eligible for huge pages."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from strata import LLM, SamplingParams
from strata.worker.huge_pages import (
    HUGE_PAGE_BYTES,
    empty_in_huge_pages,
    move_parameters_to_huge_pages,
    zeros_in_huge_pages,
)


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0]


def _thp_eligible(address: int) -> bool | None:
    """The `THPeligible` flag of the mapping holding `address` in /proc/self/smaps (None: not reported)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            mapping = start <= address < end
        elif mapping and head == "THPeligible:":
            return line.split()[1] == "1"
    return None


def test_parameters_keep_values_and_ties_in_one_aligned_arena() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 700), nn.Linear(700, 300), nn.Linear(700, 1000, bias=False))
    model[2].weight = model[0].weight  # tied, as an LM head and its embedding
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = move_parameters_to_huge_pages(model)
    after = dict(model.named_parameters())
    assert moved >= sum(t.nbytes for t in before.values())
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert model[2].weight is model[0].weight
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1  # one arena
    assert model[0].weight.data_ptr() % HUGE_PAGE_BYTES == 0
    x = torch.randint(0, 1000, (4,))
    torch.testing.assert_close(model[2](model[0](x)), model[0](x) @ before["0.weight"].T)


def test_kv_caches_are_zeroed_and_do_not_overlap() -> None:
    shapes = [(2, 5, 16, 3, 8), (2, 5, 16, 1, 8), (2, 5, 16, 3, 8)]
    caches = zeros_in_huge_pages(shapes, torch.bfloat16)
    assert [tuple(c.shape) for c in caches] == shapes
    assert all(c.dtype == torch.bfloat16 and not c.any() for c in caches)
    for i, cache in enumerate(caches):
        cache.fill_(i + 1)
    assert all(bool((c == i + 1).all()) for i, c in enumerate(caches))


@pytest.mark.skipif(
    sys.platform != "linux" or _thp_mode() not in ("always", "madvise"),
    reason="transparent huge pages are not offered by this kernel",
)
def test_the_arena_is_eligible_for_huge_pages() -> None:
    arena = empty_in_huge_pages(3 * HUGE_PAGE_BYTES)
    assert _thp_eligible(arena.data_ptr()) is True


def test_engine_output_is_unchanged_by_the_move(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens of an engine whose weights and caches are in the arenas equal those of one that keeps
    PyTorch's own allocations."""
    import strata.worker.model_runner as model_runner

    folder = str(tiny_model_dir("llama"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 40]}, {"prompt_token_ids": [3, 2]}]

    def tokens() -> list[list[int]]:
        llm = LLM(folder, skip_tokenizer_init=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    in_arenas = tokens()
    monkeypatch.setattr(model_runner, "move_parameters_to_huge_pages", lambda model: 0)
    monkeypatch.setattr(
        model_runner,
        "zeros_in_huge_pages",
        lambda shapes, dtype: [torch.zeros(shape, dtype=dtype) for shape in shapes],
    )
    assert tokens() == in_arenas
