"""`strata serve` with the bundled model, driven by the official `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from strata import LLM, SamplingParams

from remote_server import RemoteServer, assert_error, greedy, metric
from stories260k import PROMPT, PROMPT_IDS

PROMPTS = ["Once upon a time", "Lily had a dog", "The sun was", "Tom and his mom"]


# -- completions ------------------------------------------------------------------------------------------
def test_completion_greedy_matches_llm_generate(server: RemoteServer, llm: LLM) -> None:
    result = server.client().completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0, logprobs=2
    )
    choice = result.choices[0]
    assert choice.text == greedy(llm, PROMPT, 40)
    assert choice.finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (
        5,
        40,
        45,
    )
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.model == "stories260K" and result.system_fingerprint and result.created > 0
    reference = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, logprobs=2), use_tqdm=False)
    ref = reference[0].outputs[0]
    assert choice.logprobs is not None and len(choice.logprobs.tokens) == 40
    for token_id, entry, got, top in zip(
        ref.token_ids, ref.logprobs, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True
    ):
        assert got == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert 2 <= len(top) <= 3 and max(top.values()) <= 0
    assert choice.logprobs.text_offset[0] == 0


def test_streamed_completion_concatenates_to_the_same_text(server: RemoteServer, llm: LLM) -> None:
    stream = server.client().completions.create(
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
        model="stories260K",
    )
    chunks = list(stream)
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len(pieces) > 5 and "".join(pieces) == greedy(llm, PROMPT, 40)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == 40
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_is_never_streamed_in_part(server: RemoteServer, llm: LLM) -> None:
    expected = greedy(llm, PROMPT, 60, stop=["Lily. She"])
    assert expected.endswith("named ")
    stream = server.client().completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=60, temperature=0, stop=["Lily. She"], stream=True
    )
    pieces = [c.choices[0].text for c in stream]
    assert "".join(pieces) == expected and "Lily" not in "".join(pieces)


def test_prompt_lists_token_ids_n_and_echo(server: RemoteServer, llm: LLM) -> None:
    client = server.client()
    # best_of equal to n is plain sampling of n choices
    result = client.completions.create(
        model="stories260K", prompt=PROMPTS, max_tokens=12, temperature=0, n=2, best_of=2
    )
    assert [c.index for c in result.choices] == list(range(8))
    for choice in result.choices:
        assert choice.text == greedy(llm, PROMPTS[choice.index // 2], 12)
    assert result.usage.completion_tokens == 8 * 12
    ids = client.completions.create(model="stories260K", prompt=PROMPT_IDS, max_tokens=12, temperature=0)
    assert ids.choices[0].text == greedy(llm, PROMPT, 12) and ids.usage.prompt_tokens == 5
    echoed = client.completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=0
    )
    assert echoed.choices[0].text == PROMPT + greedy(llm, PROMPT, 5)
    # `<s>` is not in the text, so it is not listed; the tokens join up to the text, offsets included.
    logprobs = echoed.choices[0].logprobs
    assert len(logprobs.tokens) == 4 + 5 and logprobs.tokens[:2] == ["Once", " upon"]
    assert "".join(logprobs.tokens) == echoed.choices[0].text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(9)]
    stream = client.completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == echoed.choices[0].text


def test_null_fields_take_their_defaults(server: RemoteServer, llm: LLM) -> None:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": None, "n": None, "stop": None, "logprobs": None}
    result = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    assert (
        result["choices"][0]["text"] == greedy(llm, PROMPT, 16) and result["usage"]["completion_tokens"] == 16
    )
    assert_error(httpx.post(f"{server.url}/v1/completions", json={"prompt": None}), 400, "prompt")


def test_seeded_sampling_and_parameters_are_applied(server: RemoteServer) -> None:
    client = server.client()
    kwargs = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 7}
    first = client.completions.create(**kwargs, top_p=0.9, extra_body={"top_k": 20, "min_p": 0.01})
    again = client.completions.create(**kwargs, top_p=0.9, extra_body={"top_k": 20, "min_p": 0.01})
    assert first.choices[0].text == again.choices[0].text
    long = client.completions.create(
        model="stories260K",
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True, "min_tokens": 30},
    )
    assert long.usage.completion_tokens == 30 and long.choices[0].finish_reason == "length"


def test_concurrent_streams_are_batched(server: RemoteServer, llm: LLM) -> None:
    prompts = [f"{PROMPTS[i % 4]}{' and' * (i // 4)}" for i in range(32)]
    expected = [
        o.outputs[0].text
        for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    ]
    before = server.stats()

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model="stories260K", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in prompts))

    assert asyncio.run(run_all()) == expected
    after = server.stats()
    passes = after["num_forward_passes"] - before["num_forward_passes"]
    # 32 requests x 24 tokens alone would take 768 passes; batched they share most of them.
    assert passes < 32 * 24 / 4
    assert after["max_batch_size"] >= 8
    assert after["num_running"] == 0 and after["kv_cache_usage"] == 0


def wait_until_idle(server: RemoteServer) -> None:
    deadline = time.monotonic() + 10
    while (stats := server.stats())["num_running"] or stats["kv_cache_usage"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


LONG_REQUEST = {"prompt": PROMPT, "max_tokens": 500, "n": 8, "ignore_eos": True}


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: RemoteServer) -> None:
    aborted_before = metric(server, "strata:request_success_total", finished_reason="abort")
    body = {**LONG_REQUEST, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.stats()["kv_cache_usage"] > 0
    wait_until_idle(server)
    assert metric(server, "strata:request_success_total", finished_reason="abort") == aborted_before + 1
    assert metric(server, "strata:kv_cache_usage_perc") == 0


def test_disconnect_while_waiting_for_a_full_response_aborts_it(server: RemoteServer) -> None:
    """Regression: a client leaving a non-streaming request was answered (and counted) as a 500, as the
    cancelled work was read before its cancellation had run."""
    aborted_before = metric(server, "strata:request_success_total", finished_reason="abort")
    disconnected_before = metric(
        server, "strata:http_requests_total", endpoint="/v1/completions", status="499"
    )
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    wait_until_idle(server)
    assert metric(server, "strata:request_success_total", finished_reason="abort") == aborted_before + 1
    assert metric(server, "strata:http_requests_total", endpoint="/v1/completions", status="499") == (
        disconnected_before + 1
    )
    assert metric(server, "strata:http_requests_total", endpoint="/v1/completions", status="500") == 0


# -- other endpoints --------------------------------------------------------------------------------------
def test_models_tokenize_detokenize_version_health(server: RemoteServer) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["stories260K"] and models.data[0].object == "model"
    assert server.client().models.retrieve("stories260K").id == "stories260K"
    assert assert_error(httpx.get(f"{server.url}/v1/models/gpt-4"), 404, "model")["code"] == "model_not_found"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens == {"count": 5, "max_model_len": 512, "tokens": PROMPT_IDS}
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": PROMPT_IDS[1:]}).json()
    assert text == {"prompt": PROMPT}
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_metrics_cover_requests_tokens_and_latencies(server: RemoteServer) -> None:
    server.client().completions.create(model="stories260K", prompt=PROMPT, max_tokens=4)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "strata:http_requests_total",
        "strata:request_success_total",
        "strata:num_requests_running",
        "strata:num_requests_waiting",
        "strata:kv_cache_usage_perc",
        "strata:prompt_tokens_total",
        "strata:generation_tokens_total",
        "strata:time_to_first_token_seconds_bucket",
        "strata:inter_token_latency_seconds_bucket",
        "strata:e2e_request_latency_seconds_count",
        "strata:num_preemptions_total",
        "strata:prefix_cache_queries_total",
        "strata:prefix_cache_hits_total",
    ):
        assert name in text, name
    assert metric(server, "strata:http_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert metric(server, "strata:generation_tokens_total") >= 4
    assert metric(server, "strata:prefix_cache_queries_total") == server.stats()["prefix_cache_queries"] > 0


# -- errors -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 10**6}, "n"),
        ({"prompt": "x", "logprobs": 100}, "logprobs"),
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": "x", "stop": ["a", 3]}, "stop"),
        ({"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
        ({"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": [[1, 2], "x"]}, "prompt"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "hello " * 2000}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "logit_bias": {"50": 101}}, "logit_bias"),
        ({"prompt": "x", "suffix": "end"}, "suffix"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        # strict types: a boolean is not a number, a string not a boolean, a number not a string
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": False}, "temperature"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [True, False]}, "prompt"),
        # fields Strata does not do are named, never ignored
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "response_format": {"type": "json_object", "strict": True}}, "response_format"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
            "stream_options",
        ),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt": ["x"] * 9, "n": 128}, "prompt"),
    ],
)
def test_invalid_completion_parameters_are_400_naming_the_parameter(
    server: RemoteServer, body: dict, param: str
) -> None:
    assert_error(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30), 400, param)


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[1, 2]",
        b"null",
        b"\xff\xfe",
        b"",
        b'{"prompt": "x", "temperature": NaN}',
        b"9" * 100000,
    ],
)
def test_malformed_bodies_are_400(server: RemoteServer, content: bytes) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_huge_body_is_refused_and_the_engine_survives(server: RemoteServer, llm: LLM) -> None:
    huge = b'{"prompt": "' + b"a" * (40 * 1024 * 1024) + b'"}'
    response = httpx.post(
        f"{server.url}/v1/completions", content=huge, headers={"content-type": "application/json"}, timeout=60
    )
    assert_error(response, 413)
    long_prompt = {"prompt": [1] + [403] * 5000, "max_tokens": 4}
    assert_error(httpx.post(f"{server.url}/v1/completions", json=long_prompt, timeout=30), 400, "prompt")
    result = server.client().completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=8, temperature=0
    )
    assert result.choices[0].text == greedy(llm, PROMPT, 8)


def test_wrong_method_is_405_with_allow(server: RemoteServer) -> None:
    response = httpx.get(f"{server.url}/v1/completions")
    assert_error(response, 405)
    assert response.headers["allow"] == "POST"
    assert httpx.delete(f"{server.url}/health").headers["allow"] == "GET"


def test_openai_client_sees_typed_errors(server: RemoteServer) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt="x")
    assert not_found.value.body["param"] == "model" and not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="stories260K", prompt="x", temperature=-3)
    assert "temperature" in bad.value.body["message"]
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)


def test_chat_without_a_template_is_a_clear_400(server: RemoteServer) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        server.client().chat.completions.create(
            model="stories260K", messages=[{"role": "user", "content": "Hi"}]
        )
    assert "chat template" in bad.value.body["message"] and "--chat-template" in bad.value.body["message"]
    assert_error(httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}), 400, "messages")


def test_no_logprob_is_infinite(server: RemoteServer) -> None:
    result = server.client().completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=5, logprobs=20, temperature=0
    )
    values = [v for top in result.choices[0].logprobs.top_logprobs for v in top.values()]
    assert all(math.isfinite(v) for v in values)


# -- the serving benchmark --------------------------------------------------------------------------------
def test_serve_benchmark_reports_json_and_table(
    server: RemoteServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "serve.py"
    spec = importlib.util.spec_from_file_location("serve_benchmark", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    json_out = tmp_path / "serve.json"
    argv = ["--url", server.url, "--concurrency", "4", "--num-requests", "8", "--max-tokens", "8"]
    assert bench.main([*argv, "--json-out", str(json_out)]) == 0
    report = json.loads(json_out.read_text())
    assert report["num_requests"] == 8 and report["output_tokens"] == 64
    assert report["requests_per_s"] > 0 and report["ttft_ms"]["p50"] > 0 and report["itl_ms"]["p99"] > 0
    assert "output tokens/s" in capsys.readouterr().out
