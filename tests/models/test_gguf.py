"""GGUF files load directly, keep their quantized weights in their GGUF types, and compute what transformers
computes from the same file.

The reference is transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`, which dequantizes
every tensor) run eagerly over the whole sequence. The tiny files are random models of several
architectures written with the `gguf` writer (`gguf_models.py`), each in another quantized type.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, PretrainedConfig

from strata import LLM, SamplingParams
from strata.custom_op import reference_of
from strata.gguf.file import open_gguf
from strata.hw_agnostic.layers import GGUFEmbedding, GGUFExperts, GGUFLinear
from strata.hw_agnostic.layers.gguf import EXPERT_PROJECTIONS

from gguf_models import smollm2_gguf, write_tiny_gguf
from tiny_models import TINY_CONFIGS

Q = GGMLQuantizationType
PROMPT = [1, 5, 100, 200, 300, 400, 7, 12, 90, 33, 411, 21, 8, 170, 5, 250, 61, 44, 3, 9, 10]
DECODE_STEPS = 6
VOCAB = 512
LOGPROB_TOLERANCE = 2e-2
# A greedy decision is clear when the reference's top two logits are further apart than this; closer ones
# may go either way under the kernels' int8 activations.
CLEAR_MARGIN = 0.1


def _gguf_config(arch: str) -> PretrainedConfig:
    """The tiny config of `arch`, with what a GGUF file can express: GPT-2's default context, the defaults of the sizes some files cannot state."""
    config = TINY_CONFIGS[arch]()
    config.vocab_size = VOCAB
    if arch == "qwen3":  # qwen3 files state no head size: transformers takes the config's default
        config.head_dim = type(config)().head_dim
    if arch == "gpt2":
        config.n_positions = 1024
    if arch in ("qwen2_moe", "qwen3_moe"):  # sizes their GGUF metadata has no key for: the config's defaults
        defaults = type(config)()
        config.moe_intermediate_size = defaults.moe_intermediate_size
        config.shared_expert_intermediate_size = getattr(defaults, "shared_expert_intermediate_size", None)
    if arch == "qwen3_moe":  # rows of 256 for the K-quant experts; llama.cpp renormalises routing weights
        config.hidden_size, config.norm_topk_prob = 256, True
    return config


# Each architecture in another type, so every type the gguf library quantizes loads into some model.
CASES = {
    "llama": Q.Q4_0,
    "qwen2": Q.Q8_0,
    "qwen3": Q.Q4_1,
    "gemma3": Q.Q5_0,
    "gemma2": Q.Q5_1,
    "phi3": Q.F16,
    "starcoder2": Q.Q8_0,
    "gpt2": Q.Q4_0,
    "qwen2_moe": Q.Q8_0,
    "qwen3_moe": Q.Q4_0,
}
# Tensors written in other types, as K-quant mixes do: each expert stack of the MoE in its own K-quant.
MIXED_TYPES = {
    "qwen3_moe": {
        f"blk.{layer}.ffn_{name}_exps.weight": qtype
        for layer in range(3)
        for name, qtype in (("gate", Q.Q4_K), ("up", Q.Q5_K), ("down", Q.Q6_K))
    }
}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_gguf(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("tiny-gguf")

    @functools.cache
    def build(arch: str) -> Path:
        return write_tiny_gguf(
            _gguf_config(arch),
            folder / f"{arch}.gguf",
            qtype=CASES[arch],
            random_blocks=MIXED_TYPES.get(arch),
        )

    return build


@dataclass
class Reference:
    """transformers' greedy continuation of a prompt from a GGUF file: the tokens, the first step's logits,
    and how many leading tokens were clear decisions (top-2 logit margin above `CLEAR_MARGIN`)."""

    tokens: list[int]
    first_logits: torch.Tensor
    clear: int

    def check(self, tokens: list[int]) -> None:
        """`tokens` agree with the reference on every clear decision (up to the first close call)."""
        assert tokens[: self.clear] == self.tokens[: self.clear]


def _reference_greedy(path: Path, prompt: list[int], steps: int) -> Reference:
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, attn_implementation="eager"
    )
    tokens, margins, logits_per_step = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            logits_per_step.append(logits)
            tokens.append(int(logits.argmax()))
    clear = next((i for i, margin in enumerate(margins) if margin < CLEAR_MARGIN), steps)
    return Reference(tokens[len(prompt) :], logits_per_step[0], clear)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_tiny_architectures_match_transformers(arch: str, tiny_gguf) -> None:
    path = tiny_gguf(arch)
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=128, compile=False)
    model = llm.engine.runner.model
    kept = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert kept, f"no linear layer of {arch} kept its GGUF weights"
    assert all(m.qweight.dtype == torch.uint8 and m.qtype == CASES[arch] for m in kept)
    assert any(isinstance(m, GGUFEmbedding) for m in model.modules()), "the embedding table was dequantized"
    if getattr(model.config, "num_experts", None):
        experts = [m for m in model.modules() if isinstance(m, GGUFExperts)]
        assert len(experts) == model.config.num_hidden_layers, "the expert stacks were dequantized"
        mixed = MIXED_TYPES.get(arch, {})
        want = [mixed.get(f"blk.0.ffn_{name}_exps.weight", CASES[arch]) for name in EXPERT_PROJECTIONS]
        assert experts[0].qtypes == want
        # The platform's experts compute what the reference does (int8 activations: close, not equal).
        inputs = experts[0].example_inputs(7, torch.Generator().manual_seed(0), torch.float32)[0]
        got, want = experts[0](*inputs), reference_of(experts[0])(*inputs)
        assert (got - want).abs().max() <= 0.03 * want.abs().max()

    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    _check_against(_reference_greedy(path, PROMPT, DECODE_STEPS), out)


def test_reference_layers_compiled_match_transformers(tiny_gguf) -> None:
    """The hw-agnostic layers (every GGUF type dequantized in pure PyTorch, the experts' routing in one op)
    under torch.compile, as a platform without kernels runs them: transformers' numbers, to float32 rounding."""
    path = tiny_gguf("qwen3_moe")
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=128, compile=True, layer_impl="hw-agnostic")
    assert any(type(m) is GGUFExperts for m in llm.engine.runner.model.modules())
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    reference = _reference_greedy(path, PROMPT, DECODE_STEPS)
    reference.check(out.token_ids)
    token = reference.tokens[0]
    want_logprob = torch.log_softmax(reference.first_logits.double(), -1)[token].item()
    assert out.logprobs[0][token].logprob == pytest.approx(want_logprob, abs=1e-4)


def _check_against(reference: Reference, out) -> None:
    reference.check(out.token_ids)
    token = reference.tokens[0]
    want_logprob = torch.log_softmax(reference.first_logits.double(), -1)[token].item()
    # The CPU kernels quantize activations to int8 per block (as llama.cpp does): close, not equal.
    assert out.logprobs[0][token].logprob == pytest.approx(want_logprob, abs=LOGPROB_TOLERANCE)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2: Path) -> LLM:
    """The real file, compiled as served: one engine for the module."""
    return LLM(str(smollm2), max_model_len=512, compile=True)


def test_real_file_stays_quantized_in_its_own_memory(smollm2: Path, smollm2_llm: LLM) -> None:
    model = smollm2_llm.engine.runner.model
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    size = smollm2.stat().st_size
    assert sum(storages.values()) <= 1.15 * size
    kept = [m for m in model.modules() if isinstance(m, GGUFLinear | GGUFEmbedding)]
    assert {m.qtype for m in kept} >= {Q.Q4_1}
    # Most blocks are the mapped file itself (Llama's q/k rows are reordered into copies).
    file_map = open_gguf(smollm2).data
    start, end = file_map.ctypes.data, file_map.ctypes.data + file_map.nbytes
    mapped = [m for m in kept if start <= m.qweight.data_ptr() < end]
    assert len(mapped) >= len(kept) // 2


def test_real_file_prompt_tokens_and_logits_match_transformers(smollm2: Path, smollm2_llm: LLM) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    messages = [{"role": "user", "content": "Name a colour of the sky."}]
    for text in ["Once upon a time, in a land far away", " leading space\nand lines", "naïve café 東京"]:
        assert smollm2_llm.engine.tokenize_prompt(text)[1] == tokenizer(text).input_ids
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt).input_ids
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    out = smollm2_llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    reference = _reference_greedy(smollm2, ids, 8)
    assert reference.clear >= 2, "the reference's own first decisions should be clear"
    _check_against(reference, out)

    # The chat template renders the same prompt; its blocks now come from the prefix cache, so only the
    # last tokens run (through the kernels' few-row path): clear decisions agree, close ones may not.
    chat = smollm2_llm.chat(messages, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    reference.check(chat.token_ids)
    assert chat.text == tokenizer.decode(chat.token_ids, skip_special_tokens=True)


# Types of the compiled reference test; K-quants (which the gguf library cannot quantize to) as random blocks.
REFERENCE_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", REFERENCE_TYPES, ids=lambda t: t.name)
def test_reference_layers_compiled_match_eager(qtype: Q, tmp_path: Path) -> None:
    """The hw-agnostic GGUF layers, compiled (the dequantization fused by Inductor) and eager, on a tiny
    Llama whose every matrix is of `qtype`: the same greedy tokens, log-probabilities to float32 rounding."""
    config = TINY_CONFIGS["llama"]()
    config.vocab_size, config.hidden_size, config.intermediate_size = VOCAB, 256, 256
    config.num_hidden_layers, config.head_dim = 2, 64
    names = ["token_embd.weight", "output.weight"] + [
        f"blk.{layer}.{name}.weight"
        for layer in range(config.num_hidden_layers)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    ]
    k_quant = qtype in (Q.Q4_K, Q.Q6_K)
    path = write_tiny_gguf(
        config,
        tmp_path / "model.gguf",
        qtype=Q.F32 if k_quant else qtype,
        random_blocks=dict.fromkeys(names, qtype) if k_quant else None,
    )
    params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0, ignore_eos=True, logprobs=0)
    outputs = []
    for compile in (False, True):
        llm = LLM(
            str(path), skip_tokenizer_init=True, max_model_len=128, compile=compile, layer_impl="hw-agnostic"
        )
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, GGUFLinear)]
        assert linears and all(m.qtype == qtype for m in linears)
        # Prefill, then decode one and several sequences at once (one row and several per step).
        prompts = [{"prompt_token_ids": PROMPT[: 5 + 4 * i]} for i in range(3)]
        outputs.append(
            [
                llm.generate(prompts[0], params)[0].outputs[0],
                *(o.outputs[0] for o in llm.generate(prompts, params)),
            ]
        )
    for eager, compiled in zip(*outputs, strict=True):
        assert compiled.token_ids == eager.token_ids
        for want, got in zip(eager.logprobs, compiled.logprobs, strict=True):
            assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-3) for t in want)
