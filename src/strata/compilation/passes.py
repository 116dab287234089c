"""Strata's FX passes, run on Dynamo's graph of the whole forward before it is split at attention.

`fuse_kv_write_into_attention` turns `unified_attention(q, kv_cache_update(k, v, name), name, ...)` into
`attention_with_kv_write(q, k, v, name, ...)`: one custom-op call per layer instead of two, and no
dependency tensor. It is off by default: measured on CPU decode it made things slightly slower (README), so
it serves as the layer-name-aware fusion the pass manager and its tests exercise.

The pattern contains layer-name ops, so it is written the way `LayerName` needs: with `LayerName` the name
is a pattern input (`KeywordArg`), registered once, and matches every layer; with `str` names each name is
a constant of the graph, so one pattern per layer is registered with that layer's name as a literal. A
`str` pattern against a `LayerName` graph (or the reverse) silently matches nothing, which is why the tests
count replacements in both settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._inductor.pattern_matcher import (
    CallFunction,
    KeywordArg,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

from strata.attention.ops import attention_with_kv_write, kv_cache_update, unified_attention
from strata.compilation.layer_name import LayerName

logger = logging.getLogger("strata.compilation")

GraphPass = Callable[[fx.GraphModule], int]


class PassManager:
    """Runs the enabled passes in order; each returns how many replacements it made (summed in `counts`)."""

    def __init__(self, passes: dict[str, GraphPass]) -> None:
        self.passes = passes
        self.counts: dict[str, int] = dict.fromkeys(passes, 0)

    def __call__(self, gm: fx.GraphModule) -> None:
        for name, graph_pass in self.passes.items():
            count = graph_pass(gm)
            self.counts[name] += count
            logger.info("pass %s: %d replacements", name, count)
        gm.graph.lint()
        gm.recompile()


def fuse_kv_write_into_attention(layer_names: Sequence[str | LayerName]) -> GraphPass:
    """The pass for a model whose attention layers are called with `layer_names` (encoded)."""
    patterns = PatternMatcherPass(pass_name="fuse_kv_write_into_attention")
    use_layer_name = any(isinstance(name, LayerName) for name in layer_names)
    # One pattern with the name as an input, or one per layer with the name as a literal.
    pattern_names: list[Any] = [KeywordArg("layer_name")] if use_layer_name else list(layer_names)
    variant = layer_names[0] if layer_names else ""
    for name in pattern_names:
        kv_write = CallFunction(
            kv_cache_update.variant(variant), KeywordArg("key"), KeywordArg("value"), name, _users=1
        )
        attention = CallFunction(
            unified_attention.variant(variant),
            KeywordArg("query"),
            kv_write,
            name,
            KeywordArg("scale"),
            KeywordArg("softcap"),
            KeywordArg("sliding_window"),
        )
        register_graph_pattern(attention, pass_dict=patterns)(_replace_with_fused(name, variant))

    def run(gm: fx.GraphModule) -> int:
        return patterns.apply(gm.graph)

    return run


def _replace_with_fused(pattern_name: Any, variant: str | LayerName) -> Callable[..., None]:
    fused = attention_with_kv_write.variant(variant)

    def replace(match: Match, query: fx.Node, key: fx.Node, value: fx.Node, **kwargs: Any) -> None:
        name = kwargs.get("layer_name", pattern_name)
        attention = match.output_node()
        graph = attention.graph
        with graph.inserting_before(attention):
            node = graph.call_function(
                fused,
                (query, key, value, name, kwargs["scale"], kwargs["softcap"], kwargs["sliding_window"]),
            )
        node.meta.update(attention.meta)
        attention.replace_all_uses_with(node)
        match.erase_nodes()

    return replace


def build_passes(
    layer_names: Sequence[str | LayerName], enabled: Callable[[str], bool]
) -> dict[str, GraphPass]:
    """The enabled passes for a model with these (encoded) attention layer names, in the order they run."""
    passes: dict[str, GraphPass] = {}
    if enabled("fuse_kv_write_into_attention"):
        passes["fuse_kv_write_into_attention"] = fuse_kv_write_into_attention(layer_names)
    return passes
