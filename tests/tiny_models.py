"""Tiny random configs of the decoder-only architectures Strata must run, from transformers' config classes.

Each is small enough to run in milliseconds but keeps what makes its architecture different: GQA, sliding
windows shorter than the test prompts, logit soft-capping, q/k norms, fused qkv, scaled residuals, mixtures
of experts (whose checkpoints transformers saves per expert and fuses as it loads).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import (
    ApertusConfig,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPT2Config,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    OPTConfig,
    Phi3Config,
    PhiConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Starcoder2Config,
)

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.1,
)

# Shorter than the prompts the tests use, so the window really cuts off old keys.
SLIDING_WINDOW = 8

TINY_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=False),
    # Multi-query attention: one KV head (as Gemma 3 270M, and each rank of a split GQA model).
    "llama_mqa": lambda: LlamaConfig(**{**_COMMON, "num_key_value_heads": 1}),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=SLIDING_WINDOW),
    "qwen2": lambda: Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=32),
    "gemma": lambda: GemmaConfig(**_COMMON, head_dim=16),
    "gemma2": lambda: Gemma2Config(
        **_COMMON,
        head_dim=16,
        sliding_window=SLIDING_WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
        query_pre_attn_scalar=16,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "phi3": lambda: Phi3Config(**_COMMON),
    # LayerNorm with biases, a plain (not gated) MLP, attention and MLP in parallel, half the head rotated.
    "phi": lambda: PhiConfig(**_COMMON, partial_rotary_factor=0.5),
    # LayerNorm, biased projections, a plain MLP.
    "starcoder2": lambda: Starcoder2Config(**_COMMON),
    # LayerNorm without bias, attention and MLP in parallel, scaled logits.
    "cohere": lambda: CohereConfig(**_COMMON, logit_scale=0.5),
    # Attention modules without grouped-query attributes (one KV head per query head), learned absolute
    # positions (GPT-2, OPT), Conv1D projections (GPT-2), a fused qkv with `head_size` (GPT-NeoX).
    "gpt2": lambda: GPT2Config(
        vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2
    ),
    "gpt_neox": lambda: GPTNeoXConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "opt": lambda: OPTConfig(
        vocab_size=128,
        hidden_size=64,
        ffn_dim=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        word_embed_proj_dim=64,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # A learned activation (xIELU) whose constants are buffers the checkpoint holds; q/k norms.
    "apertus": lambda: ApertusConfig(**_COMMON),
    # Checkpoints name the experts block_sparse_moe.experts.<i>.w1/w2/w3.
    "mixtral": lambda: MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
    # experts.<i>.gate_proj/up_proj/down_proj, and a dense shared expert beside them.
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **_COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # Every layer sparse, routing weights renormalised over the chosen experts; q/k norms.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "olmo2": lambda: Olmo2Config(**_COMMON),
    "granite": lambda: GraniteConfig(
        **_COMMON,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=2.0,
    ),
}
