"""`AsyncLLMEngine` in-process, and the app's 503s while shutting down (through an ASGI transport)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import httpx
import pytest

from strata import LLM, SamplingParams
from strata.engine.async_engine import AsyncLLMEngine, EngineDeadError
from strata.entrypoints.openai.api_server import ServerConfig, build_app, freeze_startup_heap

from stories260k import PROMPT

PROMPTS = ["Once upon a time", "Lily had a dog", "The sun was", "Tom and his mom"] * 4


@pytest.fixture
def engine() -> AsyncLLMEngine:
    """A fresh engine per test: shutting one down is final."""
    return AsyncLLMEngine(LLM().engine)


async def collect(engine: AsyncLLMEngine, prompt: str, params: SamplingParams, request_id: str) -> str:
    text = ""
    async for output in engine.generate(prompt, params, request_id):
        text = output.outputs[0].text
    return text


def test_concurrent_requests_share_forward_passes(engine: AsyncLLMEngine, llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    async def main() -> list[str]:
        engine.start()
        try:
            return await asyncio.gather(*(collect(engine, p, params, str(i)) for i, p in enumerate(PROMPTS)))
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == expected
    assert engine.stats["num_forward_passes"] < len(PROMPTS) * 20 / 2
    assert engine.stats["max_batch_size"] > 1


def test_leaving_a_stream_aborts_the_request_and_frees_its_blocks(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main() -> None:
        engine.start()
        try:
            stream = engine.generate(PROMPT, params, "leaver")
            async for output in stream:
                assert not output.finished
                break
            await stream.aclose()
            for _ in range(200):
                if engine.stats["kv_cache_usage"] == 0 and engine.stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats["kv_cache_usage"] == 0 and engine.stats["num_running"] == 0
            assert not engine.engine.has_unfinished_requests()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_shutdown_fails_in_flight_requests_and_refuses_new_ones(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main() -> None:
        engine.start()
        stream = engine.generate(PROMPT, params, "running")
        await anext(stream)
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(PROMPT, params, "late"))

    asyncio.run(main())
    assert engine.stats["kv_cache_usage"] == 0


def test_app_answers_503_while_shutting_down(engine: AsyncLLMEngine) -> None:
    config = ServerConfig(model_path="bundled", model_names=["stories260K"])
    app = build_app(engine, config)

    async def main() -> None:
        engine.start()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            body = {"prompt": PROMPT, "max_tokens": 4}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            await engine.shutdown()
            stopped = await client.post("/v1/completions", json=body)
            assert stopped.status_code == 503 and stopped.json()["error"]["code"] == "service_unavailable"
            assert (await client.get("/health")).status_code == 503
            config.shutting_down = True
            refused = await client.get("/v1/models")
            assert refused.status_code == 503 and set(refused.json()["error"]) == {
                "message",
                "type",
                "param",
                "code",
            }

    asyncio.run(main())


def test_startup_heap_is_frozen_after_its_garbage_is_collected(engine: AsyncLLMEngine) -> None:
    """What `run_server` does before serving: startup's cyclic garbage is freed, and every object still alive
    (the engine's among them) leaves the collector's generations, so a full pass walks only what requests
    create afterwards. The engine still serves afterwards."""

    class Node:
        pass

    # Earlier tests' cyclic garbage would count in `tracked_before` but be freed, not frozen.
    gc.collect()
    garbage = Node()
    garbage.self = garbage  # a reference cycle only the collector can free
    collected = weakref.ref(garbage)
    del garbage
    tracked_before = len(gc.get_objects())
    try:
        frozen = freeze_startup_heap()
        assert collected() is None
        # Frozen objects that were only the moment's temporaries (the call's own frames and arguments) may
        # be freed since, which lowers the count by a few.
        assert frozen >= 0.9 * tracked_before and 0 <= frozen - gc.get_freeze_count() < 1e-3 * frozen
        assert len(gc.get_objects()) < 0.01 * tracked_before
        model = engine.engine.runner.model
        assert gc.is_tracked(model) and all(obj is not model for obj in gc.get_objects())

        async def main() -> str:
            engine.start()
            try:
                return await collect(
                    engine, PROMPT, SamplingParams(temperature=0, max_tokens=8), "after-freeze"
                )
            finally:
                await engine.shutdown()

        assert asyncio.run(main())
    finally:
        gc.unfreeze()
