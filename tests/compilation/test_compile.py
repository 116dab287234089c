"""`LLM(compile=True)`: compiled and eager engines agree, one Dynamo graph serves every batch size, identical
pieces compile once, the layer's name reaches only its attention call, the platform's passes fire.

Compiling costs seconds on two cores, so each compiled engine is built once per module.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from strata import LLM, SamplingParams
from strata.compilation import backend
from strata.compilation.layer_name import HAS_OPAQUE_TYPE, LayerName
from strata.compilation.passes import traced_value
from strata.compilation.piece_report import PieceReport
from strata.config import CompilationConfig, ConfigError
from strata.platforms.cpu.inductor import inductor_code
from strata.worker.model_runner import ModelOutput

pytestmark = pytest.mark.skipif(not HAS_OPAQUE_TYPE, reason="needs PyTorch opaque types (>= 2.11)")

# Different lengths, so decode batches shrink 3 -> 2 -> 1 and prefill mixes lengths.
PROMPTS = [[1, 43, 47, 90, 61], [1, 100], [1, 70, 80, 90, 100, 110, 120, 30, 40]]
MAX_TOKENS = [32, 20, 9]


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    """Every step's logits, recorded as the runner returns them."""
    runner = llm.engine.runner
    execute = runner.execute
    recorded: list[torch.Tensor] = []

    def recording(scheduled: Any) -> ModelOutput:
        output = execute(scheduled)
        recorded.append(output.logits.clone())
        return output

    runner.execute = recording
    return recorded


def _run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    recorded = _record_logits(llm)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], recorded


def _num_layers(llm: LLM) -> int:
    return len(llm.engine.runner.layers)


def _stats(llm: LLM) -> Any:
    compiled = llm.engine.runner.compiled
    assert compiled is not None
    return compiled.stats


def _layer_kinds(llm: LLM) -> int:
    """How many kinds of decoder layer the model has (Gemma 3 mixes sliding-window and full attention)."""
    kinds = llm.apply_model(lambda m: set(getattr(m.config, "layer_types", None) or ["full_attention"]))
    return len(kinds)


def _pass_counts(llm: LLM) -> dict[str, int]:
    compiled = llm.engine.runner.compiled
    assert compiled is not None
    return compiled.passes.counts


# (model, layer_impl, use_layer_name, mode)
CASES = [
    ("bundled", "default", True, "model"),
    ("bundled", "hw-agnostic", True, "model"),
    ("llama", "default", True, "model"),
    ("llama_mqa", "default", True, "model"),  # one KV head: a size-1 head dim in the pieces' outputs
    ("qwen3", "hw-agnostic", True, "model"),
    ("bundled", "default", False, "model"),  # str names: constants of the attention calls, between the pieces
    ("bundled", "default", True, "layer"),  # one decoder layer traced once, reused by all
    ("qwen3", "default", True, "layer"),
    ("bundled", "default", False, "layer"),  # str names: each layer its own frame and graph
    ("gemma3", "default", True, "layer"),  # sliding and full layers: one trace per kind
]
Case = tuple[str, str, bool, str]
# The CPU decode-attention kernels, alone or with the cache write: a decode step calls one of them per layer.
# The extern call of a linear that `linears_to_onednn` rewrote, as the piece reports name it.
ONEDNN_LINEAR = "strata_onednn::linear"
DECODE_KERNELS = {"strata_cpu::paged_decode_attention", "strata_cpu::decode_attention_with_kv_write"}


def attention_ops(case: Case) -> set[str]:
    """Ops a step's attention dispatches: the CPU kernels, or with the hw-agnostic layers (which come with the
    reference backend) its cache write."""
    return DECODE_KERNELS if case[1] == "default" else {"aten::index_copy_"}


@pytest.fixture(scope="module")
def runs(
    tiny_model_dir: Callable[[str], Path], bundled_model_dir: Path
) -> Iterator[Callable[[Case], dict[str, Any]]]:
    """`runs(case)` -> eager and compiled tokens, logits and the compiled engine; each case built once."""
    cache: dict[Case, dict[str, Any]] = {}
    eager: dict[tuple[str, str, bool], tuple[list[list[int]], list[torch.Tensor]]] = {}

    def get(case: Case) -> dict[str, Any]:
        if case not in cache:
            model, layer_impl, use_layer_name, mode = case
            folder = str(bundled_model_dir if model == "bundled" else tiny_model_dir(model))
            kwargs: dict[str, Any] = {"skip_tokenizer_init": True, "layer_impl": layer_impl}
            if (model, layer_impl, use_layer_name) not in eager:
                eager_llm = LLM(folder, **kwargs, compilation_config={"use_layer_name": use_layer_name})
                eager[(model, layer_impl, use_layer_name)] = _run(eager_llm)
            # The backend's split graphs with their submodules, as it made them (it then swaps in the pieces).
            splits: list[tuple[torch.fx.GraphModule, dict[str, torch.nn.Module]]] = []

            def recording_split(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
                made = split(gm)
                splits.append((made, dict(made.named_children())))
                return made

            split = backend._split
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(backend, "_split", recording_split)
                llm = LLM(
                    folder,
                    **kwargs,
                    compile=True,
                    compilation_config={
                        "mode": mode,
                        "use_layer_name": use_layer_name,
                        "use_cache": False,
                        "evaluate_guards": True,  # so a batch size that needed a recompile would get one
                    },
                )
                tokens, logits = _run(llm)
            eager_tokens, eager_logits = eager[(model, layer_impl, use_layer_name)]
            cache[case] = {
                "llm": llm,
                "tokens": tokens,
                "logits": logits,
                "eager_tokens": eager_tokens,
                "eager_logits": eager_logits,
                "splits": splits,
            }
        return cache[case]

    yield get


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_compiled_matches_eager_over_32_steps(runs: Callable[..., dict[str, Any]], case: Any) -> None:
    run = runs(case)
    assert run["tokens"] == run["eager_tokens"]
    assert len(run["tokens"][0]) == 32
    assert len(run["logits"]) == len(run["eager_logits"])
    for compiled, eager in zip(run["logits"], run["eager_logits"], strict=True):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_one_dynamo_graph_serves_every_batch_size_and_layer(
    runs: Callable[..., dict[str, Any]], case: Any
) -> None:
    llm = runs(case)["llm"]
    # Prefill of three prompts, decode batches of 3, 2 and 1: still the first graph(s), no recompilation.
    # In "layer" mode with str names each layer is its own frame by design: one graph per layer.
    per_layer_frames = case[3] == "layer" and not case[2]
    graphs = _num_layers(llm) if per_layer_frames else _layer_kinds(llm) if case[3] == "layer" else 1
    assert _stats(llm).dynamo_graphs == graphs
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert _stats(llm).dynamo_graphs == graphs
    pieces_per_graph = 2 if case[3] == "layer" else _num_layers(llm) + 1
    assert _stats(llm).pieces == graphs * pieces_per_graph


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_model_of_any_depth_compiles_at_most_three_distinct_pieces(
    runs: Callable[..., dict[str, Any]], case: Any
) -> None:
    """No piece holds a layer's name (it reaches only the attention calls between the pieces), so the pieces
    between two attention calls are one graph, with `LayerName` or str names."""
    llm = runs(case)["llm"]
    assert _stats(llm).distinct_pieces <= 3
    assert _stats(llm).compiled + _stats(llm).loaded == _stats(llm).distinct_pieces


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_pieces_use_the_cpp_wrapper(runs: Callable[..., dict[str, Any]], case: Any) -> None:
    """No piece takes a layer name (which the C++ wrapper cannot pass to an op), so every piece compiles with
    Inductor's C++ wrapper, the CPU platform's choice."""
    stats = _stats(runs(case)["llm"])
    assert stats.compiled_cpp_wrapper == stats.compiled > 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_compiled_forward_calls_attention_without_the_dispatcher(
    runs: Callable[..., dict[str, Any]], case: Any
) -> None:
    """Between the pieces the attention op runs as its implementation (`_EagerAttention`), as in eager
    forwards: no `strata::` op goes through the dispatcher."""
    llm = runs(case)["llm"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3), use_tqdm=False)
    ops = {event.key for event in profile.key_averages()}
    assert ops & attention_ops(case)  # attention ran, and the profiler saw ops
    assert {op for op in ops if op.startswith("strata::")} == set()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_pieces_take_sizes_from_their_tensors_not_as_int_inputs(
    runs: Callable[..., dict[str, Any]], case: Any
) -> None:
    """Inductor's C++ wrapper makes a tensor of every int input on every call, so the backend has each
    piece read a size it needs from a tensor input that has it (`_sizes_from_tensor_inputs`). An int input
    stays only where no tensor input of the piece has that size (the first piece asserts the kept-row
    count)."""
    splits = runs(case)["splits"]
    assert splits
    for _, submodules in splits:
        for piece in submodules.values():
            if not backend.is_piece(piece):
                continue
            values = [traced_value(n) for n in piece.graph.nodes if n.op == "placeholder"]
            tensor_sizes = {
                size.node.expr
                for value in values
                if isinstance(value, torch.Tensor)
                for size in value.shape
                if isinstance(size, torch.SymInt)
            }
            int_inputs = {value.node.expr for value in values if isinstance(value, torch.SymInt)}
            assert not int_inputs & tensor_sizes


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_pieces_are_called_straight_into_inductors_code(
    runs: Callable[..., dict[str, Any]], case: Any
) -> None:
    """After a piece's first call its CPU code is called without AOTAutograd's runtime wrapper and
    `CompiledFxGraph.__call__` (`backend.inductor_code`); the latter marks each call it makes in a profile.
    Nor does the generated code call back into Python for an op (Inductor's `custom_op_wrapper`, its path for
    ops whose schema its C++ wrapper cannot call, such as a list return). The outputs of those direct calls
    are what the matches-eager test compares."""
    llm = runs(case)["llm"]
    python_calls: set[str] = set()
    sys.setprofile(
        lambda frame, event, _: python_calls.add(frame.f_code.co_name) if event == "call" else None
    )
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3), use_tqdm=False)
    finally:
        sys.setprofile(None)
    events = {event.key for event in profile.key_averages()}
    assert events & attention_ops(case)  # the profiler saw the step
    assert not [event for event in events if event.startswith("## Call CompiledFxGraph")]
    assert "generate" in python_calls and "custom_op_wrapper" not in python_calls


@pytest.mark.parametrize("use_layer_name", [True, False])
def test_each_layer_attends_through_the_one_op_with_its_own_name(
    runs: Callable[..., dict[str, Any]], use_layer_name: bool
) -> None:
    """Every layer's attention is one call of `strata::attention` (`attention_str` with str names), a split
    point of the graph taking that layer's name; the outputs, which depend on every layer's cache, match
    eager."""
    run = runs(("bundled", "default", use_layer_name, "model"))
    llm = run["llm"]
    names = llm.apply_model(
        lambda m: [m_.strata_layer_name for m_ in m.modules() if hasattr(m_, "strata_layer_name")]
    )
    assert all(isinstance(name, LayerName) == use_layer_name for name in names)
    op = torch.ops.strata.attention if use_layer_name else torch.ops.strata.attention_str
    for split, submodules in run["splits"]:
        attended = [
            node.args[3]
            for call in split.graph.nodes
            if call.op == "call_module"
            for node in submodules[call.target].graph.nodes
            if node.op == "call_function" and node.target == op.default
        ]
        if use_layer_name:
            assert len(attended) == len(names)  # each a graph input, the name given at the call
        else:
            assert attended == names
    assert run["tokens"] == run["eager_tokens"]


def test_a_switched_off_pass_does_not_run(bundled_model_dir: Path) -> None:
    llm = LLM(
        str(bundled_model_dir),
        skip_tokenizer_init=True,
        compile=True,
        compilation_config={"passes": {"group_sibling_linears": False}, "use_cache": False},
    )
    assert list(_pass_counts(llm)) == ["fuse_residual_add_into_rms_norm", "linears_to_onednn"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_residual_add_fuses_into_every_rms_norm(runs: Callable[..., dict[str, Any]], case: Any) -> None:
    """Every residual add feeding a norm is fused where the norm is Strata's CPU kernel: two per layer over
    the whole forward (the attention residual into the next norm, the MLP residual into the next layer's or
    the final norm), one per traced layer (the MLP residual feeds the next layer, outside the trace; Gemma
    norms the attention output, adds, then norms again: also one). The hw-agnostic norm is plain tensor
    math for Inductor to fuse itself, so there is nothing to match. Outputs: the matches-eager test."""
    run = runs(case)
    _, layer_impl, _, mode = case
    llm = run["llm"]
    if layer_impl == "hw-agnostic":
        expected = 0
    elif mode == "model":
        expected = 2 * _num_layers(llm)
    else:
        expected = _stats(llm).dynamo_graphs
    assert _pass_counts(llm)["fuse_residual_add_into_rms_norm"] == expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_q_k_and_v_projections_group_into_one_linear_call(
    runs: Callable[..., dict[str, Any]], case: Any
) -> None:
    """Strata's CPU linears that read one input group into one `linear_group` call: one per attention layer
    (q, k and v; the MLP's gate and up are one weight already). The hw-agnostic layers use `F.linear`, which
    Inductor sees through, so there is nothing to group. Outputs: the matches-eager test."""
    run = runs(case)
    _, layer_impl, _, mode = case
    llm = run["llm"]
    per_graph = 1 if mode == "layer" else _num_layers(llm)
    expected = 0 if layer_impl == "hw-agnostic" else per_graph * _stats(llm).dynamo_graphs
    assert _pass_counts(llm)["group_sibling_linears"] == expected


@pytest.mark.parametrize("case", [c for c in CASES if c[3] == "model"], ids=lambda c: "-".join(map(str, c)))
def test_plain_linears_go_to_onednn(runs: Callable[..., dict[str, Any]], case: Any) -> None:
    """Every linear left as `F.linear` (all of them with the hw-agnostic layers, none where Strata's CPU
    kernels serve them) becomes oneDNN's matmul on the same weight. Outputs: the matches-eager test."""
    llm = runs(case)["llm"]
    plain = [row for row in llm.layer_providers() if row["op"] == "linear" and row["provider"] == "hw-agnostic"]
    assert _pass_counts(llm)["linears_to_onednn"] == len(plain) * _stats(llm).dynamo_graphs


def test_layer_mode_traces_one_layer_for_all_and_str_names_one_per_layer(
    runs: Callable[..., dict[str, Any]],
) -> None:
    """Frame reuse across layers is only sound when the name is an input: with str names every layer must
    get its own trace (a reused str frame would bake the first layer's name into every layer)."""
    shared = runs(("bundled", "default", True, "layer"))
    per_layer = runs(("bundled", "default", False, "layer"))
    assert _stats(shared["llm"]).dynamo_graphs == 1
    assert _stats(per_layer["llm"]).dynamo_graphs == _num_layers(per_layer["llm"])
    assert shared["tokens"] == per_layer["tokens"] == shared["eager_tokens"]


def piece_reports(llm: LLM) -> list[PieceReport]:
    """The report of every distinct piece the engine compiled or loaded; each must have one."""
    compiled = llm.engine.runner.compiled
    assert compiled is not None
    reports = [report for report in compiled.backend.piece_reports.values() if report is not None]
    assert len(reports) == compiled.stats.distinct_pieces > 0
    return reports


def test_reports_show_generated_norms_and_activations_and_matmuls_called(
    runs: Callable[..., dict[str, Any]],
) -> None:
    """With the hw-agnostic layers every piece is tensor math: Inductor generates kernels for the RMSNorms and
    the SiLU (decomposed into exp and div) and calls a matmul library (oneDNN's, `linears_to_onednn`) for
    each linear. The piece between two attention calls holds one decoder layer's linears, so it calls the
    matmul that many times."""
    llm = runs(("bundled", "hw-agnostic", True, "model"))["llm"]
    reports = piece_reports(llm)
    assert all(report.generated_kernels > 0 for report in reports)
    assert {op for report in reports for op in report.extern_calls} == {ONEDNN_LINEAR}
    generated = {op for report in reports for op in report.fused_ops}
    assert {"aten::pow", "aten::mean", "aten::rsqrt", "aten::exp", "aten::div"} <= generated
    linears = [
        row
        for row in llm.layer_providers()
        if row["op"] == "linear" and row["module"].startswith("model.layers.0.")
    ]
    assert max(report.extern_calls[ONEDNN_LINEAR] for report in reports) == len(linears)


def test_reports_show_the_cpu_kernels_as_extern_calls(runs: Callable[..., dict[str, Any]]) -> None:
    """With the CPU layers the linears and norms are Strata's kernels: the pieces call them, and no norm math
    is left for Inductor to generate (it generates the rotary embedding's)."""
    reports = piece_reports(runs(("bundled", "default", True, "model"))["llm"])
    called = {op for report in reports for op in report.extern_calls}
    assert {"strata_cpu::linear", "strata_cpu::linear_group", "strata_cpu::fused_add_rms_norm"} <= called
    assert all(op.startswith("strata_cpu::") for op in called)
    generated = {op for report in reports for op in report.fused_ops}
    assert "aten::cos" in generated and not {"aten::rsqrt", "aten::mean"} & generated


def _piece_sources(llm: LLM) -> list[str]:
    """The generated source of each distinct piece compiled so far (with the C++ wrapper, its C++ is in it)."""
    pieces = llm.engine.runner.compiled.backend._pieces.values()
    codes = [inductor_code(piece) for piece in pieces]
    assert codes and all(code is not None for code in codes)
    return [Path(code.__globals__["__file__"]).read_text() for code in codes]


def test_after_the_first_step_the_graph_is_called_without_dynamos_code(
    runs: Callable[..., dict[str, Any]], bundled_model_dir: Path
) -> None:
    """With guards checked once (the default), later steps call the split graph with an argument list built
    at the first step (`DirectForward`), not through the trace's Dynamo code, and compute what it does: the
    same tokens and logits as the engine that checks guards every step (and so always calls the trace)."""
    llm = LLM(str(bundled_model_dir), skip_tokenizer_init=True, compile=True)
    compiled = llm.engine.runner.compiled
    assert compiled is not None
    _run(llm)
    assert compiled._direct is not None
    trace_calls = []
    trace = compiled._trace
    compiled._trace = lambda *args: trace_calls.append(args) or trace(*args)
    tokens, logits = _run(llm)
    assert trace_calls == []
    reference = runs(("bundled", "default", True, "model"))
    assert tokens == reference["tokens"]
    # The reference engine's record goes on with other tests' steps: its first steps are the ones to match.
    for direct, through_dynamo in zip(logits, reference["logits"][: len(logits)], strict=True):
        torch.testing.assert_close(direct, through_dynamo, rtol=0, atol=1e-5)


def test_inductor_options_reach_every_piece(
    runs: Callable[..., dict[str, Any]], bundled_model_dir: Path, threads: Callable[[int], None]
) -> None:
    """`inductor_compile_config` reaches Inductor for every piece: on two threads Inductor's own loops are
    OpenMP loops, with `cpp.threads` 1 they are serial. Both compute as eager does."""
    threads(2)  # with one, Inductor never parallelises a loop anyway
    eager = runs(("bundled", "default", True, "model"))
    for options, parallel in (({}, True), ({"cpp.threads": 1}, False)):
        llm = LLM(
            str(bundled_model_dir),
            skip_tokenizer_init=True,
            compile=True,
            adaptive_threads=False,
            compilation_config={"use_cache": False, "inductor_compile_config": options},
        )
        tokens, logits = _run(llm)
        assert all(("#pragma omp parallel" in source) == parallel for source in _piece_sources(llm)), options
        assert tokens == eager["eager_tokens"]
        for compiled, reference in zip(logits, eager["eager_logits"], strict=True):
            torch.testing.assert_close(compiled, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cpp.no_such_option": 1}, r"'cpp.no_such_option' is not an option of torch\._inductor\.config"),
        ({"no_such_option": 1}, "'no_such_option' is not an option"),
        ({"cpp.": 1}, "is not an option"),
        ({"cpp": 1}, "'cpp' is not an option"),  # a group of options, not one
        ([("cpp.threads", 1)], "must be a dict"),
        ({"cpp.threads": "2"}, "'cpp.threads' takes a value of type int, got '2'"),
        ({"cpp.threads": True}, "takes a value of type int"),
        ({"size_asserts": 1}, "'size_asserts' takes a value of type bool"),
        ({"cpp.simdlen": 8.0}, r"'cpp.simdlen' takes a value of type int \| None"),
    ],
)
def test_wrong_inductor_options_are_refused_at_construction(
    bundled_model_dir: Path, options: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        LLM(str(bundled_model_dir), compile=True, compilation_config={"inductor_compile_config": options})


@pytest.mark.parametrize(
    "options",
    [
        {"cpp.simdlen": None},
        {"cpp.simdlen": 8},
        {"cpp.cxx": (None, "g++")},
        {"max_autotune_gemm_backends": "ATEN"},
    ],
)
def test_inductor_option_values_of_the_declared_type_are_accepted(options: dict[str, Any]) -> None:
    assert CompilationConfig(inductor_compile_config=options).inductor_compile_config == options
