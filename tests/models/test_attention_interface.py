"""The transformers glue: no dense masks are built, and every attention layer gets a name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.masking_utils import create_causal_mask

from strata import LLM
from strata.compilation.layer_name import resolve_layer_name
from strata.models.transformers.attention import ATTN_IMPLEMENTATION, register_attention_interface


def test_hf_builds_no_mask_for_strata_attention(tiny_model_dir: Callable[[str], Path]) -> None:
    register_attention_interface()
    config = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    config._attn_implementation = ATTN_IMPLEMENTATION
    embeds = torch.zeros(1, 12, config.hidden_size)
    mask = create_causal_mask(
        config=config,
        inputs_embeds=embeds,
        attention_mask=None,
        cache=None,
        position_ids=torch.arange(12)[None],
    )
    assert mask is None
    config._attn_implementation = "eager"  # the control: HF does build one for its own implementations
    assert (
        create_causal_mask(
            config=config,
            inputs_embeds=embeds,
            attention_mask=None,
            cache=None,
            position_ids=torch.arange(12)[None],
        )
        is not None
    )


def test_every_attention_layer_is_named_and_has_a_cache(tiny_model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model_dir("gemma3")), skip_tokenizer_init=True)
    names = llm.apply_model(
        lambda model: [
            resolve_layer_name(m.strata_layer_name)
            for m in model.modules()
            if hasattr(m, "strata_layer_name")
        ]
    )
    assert names == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert sorted(llm.engine.runner.kv_caches) == sorted(names)
