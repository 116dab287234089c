"""Tensor and pipeline parallelism over two processes (gloo, one thread each): the same greedy tokens and
logprobs as one process on several architectures, each tensor-parallel rank holding its half of the
sharded weights and KV heads, each pipeline stage its share of the layers, compiled or not, GGUF weights
in their types, both kinds at once over four processes; steps of a pipeline in flight together; clear
errors for models that cannot be split; the openai client against
`strata serve` with two ranks, and a rank killed mid-generation failing the server fast; two torchrun
"nodes"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from strata import LLM, SamplingParams
from strata.config import ConfigError
from strata.models.transformers.pipeline_parallel import stage_layers
from strata.worker.ranks import RankFailedError

from gguf_models import write_tiny_gguf
from remote_server import RemoteServer, free_port
from stories260k import GREEDY_55, PROMPT, PROMPT_IDS
from tiny_models import TINY_CONFIGS

# One torch thread per rank: the two ranks share this machine's cores.
THREAD_ENV = {**os.environ, "STRATA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
PROMPT_TOKENS = {"prompt_token_ids": [5, 17, 33, 9, 100, 42, 7, 8, 64, 3, 91, 12, 5, 6]}
PARAMS = SamplingParams(temperature=0, max_tokens=10, logprobs=5, prompt_logprobs=5, ignore_eos=True)


def max_logprob_difference(one, two) -> float:
    """The largest difference between two outputs' logprobs of the same candidates, sampled and prompt."""
    steps = list(zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True))
    steps += list(zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:], strict=True))
    return max(abs(a[t].logprob - b[t].logprob) for a, b in steps for t in a if t in b)


def run_both(folder: Path, quantization: str | None = None, **options: object) -> tuple:
    single = LLM(str(folder), skip_tokenizer_init=True, quantization=quantization)
    expected = single.generate([PROMPT_TOKENS], PARAMS, use_tqdm=False)[0]
    sharded = LLM(str(folder), skip_tokenizer_init=True, quantization=quantization, **options)
    try:
        got = sharded.generate([PROMPT_TOKENS], PARAMS, use_tqdm=False)[0]
        shapes = sharded.apply_model(
            lambda model: {name: tuple(p.shape) for name, p in model.named_parameters()}
        )
        kv_heads = [spec.num_kv_heads for spec in sharded.engine.runner.layers]
    finally:
        sharded.shutdown()
    full = single.apply_model(lambda model: {name: tuple(p.shape) for name, p in model.named_parameters()})
    full_kv_heads = [spec.num_kv_heads for spec in single.engine.runner.layers]
    return expected, got, full, shapes, full_kv_heads, kv_heads


def check_tensor_parallel_rank_0(
    arch: str, full: dict, shapes: dict, full_kv_heads: list, kv_heads: list
) -> None:
    """Rank 0 holds half of each sharded projection, and so half of the parameters of each layer it
    splits, and half of the KV heads; an embedding not tied to the head half of the token rows, and a
    zero row that the other rank's tokens read."""
    embedding = "model.embed_tokens.weight"
    if "lm_head.weight" in full:
        vocab, hidden = full[embedding]
        assert shapes.pop(embedding) == (vocab // 2 + 1, hidden)
    halved = [name for name in shapes if shapes[name] != full[name]]
    assert halved, "nothing was sharded"
    for name in halved:
        assert sum(shapes[name]) < sum(full[name]) and any(
            s * 2 == f for s, f in zip(shapes[name], full[name], strict=True)
        ), name
    if arch != "phi3":  # Phi-3's plan gathers the fused qkv back: every rank attends over all heads
        assert kv_heads == [max(1, heads // 2) for heads in full_kv_heads]


def check_pipeline_rank_0(arch: str, full: dict, shapes: dict, full_kv_heads: list, kv_heads: list) -> None:
    """Rank 0, the first stage, holds the embedding and the first of the model's 3 layers whole (one or
    two: the last stage also runs the head), no later layer, final norm or head; its KV cache covers its
    layers only."""

    def layer(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[2]) if parts[1] == "layers" else None

    local = {layer(name) for name in shapes} - {None}
    assert local in ({0}, {0, 1}) and len(kv_heads) == len(local) and len(full_kv_heads) == 3
    assert {name for name in full if layer(name) in (None, *local)} - set(shapes) == {
        name for name in full if name.startswith(("model.norm.", "lm_head."))
    }
    assert all(shapes[name] == full[name] for name in shapes)


def test_stages_split_the_layers_by_their_cost() -> None:
    """Consecutive layers, at least one a stage, the costliest stage as cheap as it can be; the head's
    parameters count on the last stage."""
    assert [stage_layers([1] * 7, 0, s, 2) for s in range(2)] == [range(0, 3), range(3, 7)]
    assert [stage_layers([1] * 8, 0, s, 3) for s in range(3)] == [range(0, 2), range(2, 5), range(5, 8)]
    # A head of 9 layers' parameters (a small model's vocabulary): the last stage keeps one layer.
    assert [stage_layers([1] * 6, 9, s, 2) for s in range(2)] == [range(0, 5), range(5, 6)]
    assert [stage_layers([4, 1, 1, 4], 0, s, 2) for s in range(2)] == [range(0, 2), range(2, 4)]
    with pytest.raises(ConfigError, match="3 decoder layers, fewer than pipeline_parallel_size=4"):
        stage_layers([1] * 3, 0, 0, 4)


# Dense GQA, q/k norms, sliding windows, a mixture of experts, Phi-3's fused qkv (gathered, not split),
# biased projections with a plain MLP.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3_moe", "phi3", "starcoder2"])
@pytest.mark.parametrize(
    ("option", "check_rank_0"),
    [
        ("tensor_parallel_size", check_tensor_parallel_rank_0),
        ("pipeline_parallel_size", check_pipeline_rank_0),
    ],
)
def test_two_ranks_match_one_process(
    tiny_model_dir: Callable[[str], Path], arch: str, option: str, check_rank_0: Callable[..., None]
) -> None:
    expected, got, *parts = run_both(tiny_model_dir(arch), **{option: 2})
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert max_logprob_difference(expected, got) < 1e-4
    check_rank_0(arch, *parts)


def test_two_stages_of_two_ranks_match_one_process(tiny_model_dir: Callable[[str], Path]) -> None:
    """Tensor and pipeline parallel together: 4 processes, each stage sharded over 2 ranks; rank 0 holds
    half of each projection of its stage's layers only."""
    expected, got, full, shapes, full_kv_heads, kv_heads = run_both(
        tiny_model_dir("llama"), tensor_parallel_size=2, pipeline_parallel_size=2
    )
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert max_logprob_difference(expected, got) < 1e-4
    layers = {name.split(".")[2] for name in shapes if ".layers." in name}
    assert layers in ({"0"}, {"0", "1"}) and len(kv_heads) == len(layers)
    assert {name for name in full if ".layers." in name and name.split(".")[2] in layers} == {
        name for name in shapes if ".layers." in name
    }
    q = "model.layers.0.self_attn.q_proj.weight"
    assert shapes[q] == (full[q][0] // 2, full[q][1]) and kv_heads[0] == full_kv_heads[0] // 2


def test_int8_weights_shard(tiny_model_dir: Callable[[str], Path]) -> None:
    """quantization="int8": each rank quantizes its slice of a weight as it streams in (row-wise slices
    get their own per-row scales, so logprobs move by the int8 rounding of half rows)."""
    expected, got, full, shapes, *_ = run_both(
        tiny_model_dir("llama"), quantization="int8", tensor_parallel_size=2
    )
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    q, o = (f"model.layers.0.self_attn.{name}.qweight" for name in ("q_proj", "o_proj"))
    assert shapes[q] == (full[q][0] // 2, full[q][1]) and shapes[o] == (full[o][0], full[o][1] // 2)


@pytest.mark.parametrize("option", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_gguf_weights_split_in_their_types(tmp_path: Path, option: str) -> None:
    """A Q8_0 file: rank 0 keeps its rows, or its whole blocks of columns, of each quantized matrix (a
    split inside a block loads that matrix dense), or its stage's layers."""
    path = write_tiny_gguf(TINY_CONFIGS["llama"](), tmp_path / "llama-q8_0.gguf")
    expected, got, full, shapes, *_ = run_both(path, **{option: 2})
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    # The C++ kernels sum the halves of a row-wise split in another order.
    assert max_logprob_difference(expected, got) < 1e-3
    q, o, down = (
        f"model.layers.0.{name}.qweight" for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")
    )
    if option == "tensor_parallel_size":
        assert shapes[q] == (full[q][0] // 2, full[q][1])  # rows
        assert shapes[o] == (full[o][0], full[o][1] // 2)  # 64 columns: a Q8_0 block each
        assert down not in shapes and shapes[down.replace("qweight", "weight")] == (64, 48)  # 96 columns
    else:
        layers = {name.split(".")[2] for name in shapes if ".layers." in name}
        assert layers in ({"0"}, {"0", "1"})
        assert {name for name in shapes if ".layers." in name} == {
            name for name in full if ".layers." in name and name.split(".")[2] in layers
        }
        assert shapes[q] == full[q]


def test_pipeline_keeps_steps_in_flight_and_survives_aborts(tiny_model_dir: Callable[[str], Path]) -> None:
    """Requests of different lengths, prompts chunked: both stages have a step at once, every request
    gets one process's tokens, and one aborted while its step is in flight frees its blocks."""
    folder = str(tiny_model_dir("qwen3"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 120 + 3 for j in range(5 + 9 * i)]} for i in range(6)]
    options = {"skip_tokenizer_init": True, "max_num_batched_tokens": 32}
    expected = LLM(folder, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(folder, pipeline_parallel_size=2, **options)
    engine = llm.engine
    try:
        depths = []
        submit = engine.executor.submit

        def recording_submit(scheduled):  # the real submit, noting how many steps are in flight after it
            submit(scheduled)
            depths.append(len(engine.executor._in_flight))

        engine.executor.submit = recording_submit
        got = llm.generate(prompts, params, use_tqdm=False)
        assert max(depths) == 2
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        for one, two in zip(expected, got, strict=True):
            assert max_logprob_difference(one, two) < 1e-4

        for index, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(index))
        while not any(engine.scheduler.is_in_flight(item.seq) and item.seq.request.request_id == "3"
                      for schedule in engine._in_flight for item in schedule.scheduled):  # fmt: skip
            engine.step()
        engine.abort_request("3")
        finished = {}
        while engine.has_unfinished_requests() or engine._in_flight:
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
        assert sorted(finished) == ["0", "1", "2", "4", "5"]
        for request_id, output in finished.items():
            assert output.outputs[0].token_ids == expected[int(request_id)].outputs[0].token_ids
        assert engine.scheduler.block_manager.usage == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("option", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_compiled_bundled_model_tells_the_same_story(option: str) -> None:
    llm = LLM(compile=True, **{option: 2})
    try:
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=55), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert out.prompt_token_ids == PROMPT_IDS
    assert out.outputs[0].token_ids == GREEDY_55


@pytest.mark.parametrize("option", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_an_idle_engine_lives_and_a_hung_rank_fails_it(option: str) -> None:
    """The other ranks wait for the next step (in a collective, or for a message) with a timeout; while
    the engine is idle, rank 0's keep-alive messages keep that wait short of the timeout. A rank that
    stops answering (suspended) fails the engine after the timeout, naming it, instead of hanging it."""
    before = set(psutil.Process().children())
    llm = LLM(distributed_timeout=2.0, **{option: 2})
    [rank_1] = [
        child
        for child in psutil.Process().children()
        if child not in before and "spawn_main" in " ".join(child.cmdline())
    ]
    try:
        params = SamplingParams(temperature=0, max_tokens=55)
        time.sleep(5)
        assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == GREEDY_55
        rank_1.suspend()
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank.? \[?1\]? .*within 2.0 s"):
            llm.generate(PROMPT, params, use_tqdm=False)
        assert time.monotonic() - start < 30
    finally:
        rank_1.kill()
        llm.shutdown()


def test_models_that_cannot_be_sharded_are_clear_errors(tiny_model_dir: Callable[[str], Path]) -> None:
    with pytest.raises(ConfigError, match="no tensor-parallel plan"):
        LLM(str(tiny_model_dir("gpt2")), skip_tokenizer_init=True, tensor_parallel_size=2)
    # 4 attention heads do not split over 3 ranks; the spawned ranks are stopped, nothing hangs.
    start = time.monotonic()
    with pytest.raises(ConfigError, match="do not split over tensor_parallel_size=3"):
        LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, tensor_parallel_size=3)
    assert time.monotonic() - start < 60
    assert not psutil.Process().children(recursive=True) or all(
        "resource_tracker" in " ".join(child.cmdline()) for child in psutil.Process().children(recursive=True)
    )


def test_models_that_cannot_be_split_into_stages_are_clear_errors(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    with pytest.raises(ConfigError, match="no pipeline-parallel plan"):
        LLM(str(tiny_model_dir("gpt2")), skip_tokenizer_init=True, pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="3 decoder layers, fewer than pipeline_parallel_size=4"):
        LLM(str(tiny_model_dir("llama")), skip_tokenizer_init=True, pipeline_parallel_size=4)


@cache
def expected_story() -> str:
    """The bundled model's greedy 55 tokens, from one process."""
    params = SamplingParams(temperature=0, max_tokens=55)
    return LLM().generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_server_with_two_ranks_and_a_rank_killed_mid_generation(kind: str) -> None:
    story = expected_story()  # (first: it builds the CPU kernels the server then finds built)
    server = RemoteServer(f"--{kind}-parallel-size", "2")
    try:
        client = server.client()
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=55, temperature=0)
        assert reply.choices[0].text == story

        ranks = [
            child
            for child in psutil.Process(server.process.pid).children(recursive=True)
            if "spawn_main" in " ".join(child.cmdline())
        ]
        assert len(ranks) == 1
        answers: dict[str, httpx.Response] = {}

        def long_request() -> None:
            body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "n": 16}
            answers["reply"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

        worker = threading.Thread(target=long_request)
        worker.start()
        # Kill the rank once the request runs (a fixed wait lets a fast machine finish it first).
        deadline = time.monotonic() + 60
        while not server.stats()["num_running"]:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.02)
        ranks[0].kill()
        worker.join(timeout=120)
        reply = answers["reply"]
        assert reply.status_code == 503
        assert f"{kind}-parallel rank 1 died" in reply.json()["error"]["message"]
        assert server.process.wait(timeout=60) == 1  # non-zero, for a supervisor to restart it
    finally:
        server.stop()
    assert f"the engine failed: {kind}-parallel rank 1 died" in server.output


@pytest.mark.parametrize("kind", ["tensor", "pipeline"])
def test_torchrun_two_nodes_serve_one_model(tmp_path: Path, kind: str) -> None:
    """`torchrun --nnodes 2` on 127.0.0.1, one process per "node": rank 0 serves the OpenAI API, rank 1
    runs its shard (or stage) of each step, messages going through the process group; stopping rank 0
    stops both."""
    story = expected_story()  # (first: it builds the CPU kernels the ranks then find built)
    store, port = free_port(), free_port()
    torchrun = Path(sys.executable).parent / "torchrun"
    nodes = []
    for node in (0, 1):
        command = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node)]
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store}"]
        command += [
            "-m",
            "strata.entrypoints.cli",
            "serve",
            f"--{kind}-parallel-size",
            "2",
            "--port",
            str(port),
        ]
        log = (tmp_path / f"node{node}.log").open("w")
        nodes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=THREAD_ENV))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert all(node.poll() is None for node in nodes), (tmp_path / "node0.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(
            model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=55, temperature=0
        )
        assert reply.choices[0].text == story
        # SIGTERM to rank 0 (node 0's worker process): it stops serving and tells rank 1 to stop, and
        # both torchrun agents see their process exit 0.
        [rank0] = psutil.Process(nodes[0].pid).children()
        rank0.send_signal(signal.SIGTERM)
        assert [node.wait(timeout=120) for node in nodes] == [0, 0]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert "2 ranks launched by torchrun" in (tmp_path / "node0.log").read_text()
