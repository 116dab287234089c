"""`AsyncLLMEngine`: an `LLMEngine` stepped by one background thread, fed and drained from asyncio.

The engine is not thread-safe, so only one thread ever touches it. Callers put adds and aborts into a
thread-safe inbox; the engine thread runs the engine loop (`engine_loop.run_engine_loop`) on it and hands
each step's outputs to the event loop in one call. Torch releases the GIL in its kernels, so the event
loop keeps serving HTTP while the model runs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from strata.engine.engine_client import EngineClient
from strata.engine.engine_loop import Command, EngineDeadError, run_engine_loop
from strata.engine.llm_engine import LLMEngine
from strata.engine.prompts import PromptType
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError"]


class AsyncLLMEngine(EngineClient):
    """Runs the engine loop in a dedicated thread; `generate()` streams one request's cumulative outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.tokenizer, engine.max_model_len, engine.vocab_size)
        self.engine = engine
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Written by the engine thread after every pass of its loop, read anywhere.
        self._stats: dict[str, Any] = engine.stats()

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        if self._thread is None:
            return
        self._inbox.put(("stop", None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.engine.shutdown()
        self._fail_unstarted()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and not self._stopping

    @property
    def stats(self) -> dict[str, Any]:
        return self._stats

    # -- requests -------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.engine.tokenize_prompt(prompt)

    def _submit(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> None:
        self._inbox.put(("add", (request_id, prompt, params)))

    def _release(self, request_id: str, finished: bool) -> None:
        if not finished:
            self._inbox.put(("abort", request_id))

    # -- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        failure = run_engine_loop(self.engine, self._receive, self._deliver_step)
        if failure is not None:
            self._stopping = True
            self._failed(failure)

    def _receive(self, block: bool) -> list[Command]:
        """Block only when idle; otherwise take whatever arrived and keep stepping."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _deliver_step(self, outputs: list[RequestOutput], failures: dict[str, BaseException]) -> None:
        self._stats = self.engine.stats()
        if outputs or failures:
            self.deliver_threadsafe(outputs, failures)
