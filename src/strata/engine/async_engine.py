"""`AsyncLLMEngine`: an `LLMEngine` stepped by one background thread, fed and drained from asyncio.

The server handles many HTTP requests at once but the engine is not thread-safe, so only one thread ever
touches it. Callers put adds and aborts into a thread-safe inbox; the engine thread applies them between
steps, steps while any request is unfinished (so requests that arrive while others run join the same
forward passes), and hands each step's outputs to the event loop in one `call_soon_threadsafe` call, which
routes them to per-request asyncio queues. Torch releases the GIL in its kernels, so the event loop keeps
serving HTTP while the model runs.

Tokenizing and detokenizing what clients send (prompts, chat templates, token lists) can take seconds for
large inputs, so callers run it through `run_tokenizer`, on a small thread pool beside the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from strata.engine.llm_engine import LLMEngine, PromptType
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams
from strata.worker.tensor_parallel import RankFailedError

logger = logging.getLogger("strata.async_engine")


class EngineDeadError(RuntimeError):
    """The engine is shutting down or stopped: the request cannot be (or was not) completed."""


T = TypeVar("T")

# Threads tokenizing requests at once: enough that one huge prompt does not queue every other request
# behind it, few enough that many huge prompts cannot take every core from the engine.
TOKENIZER_THREADS = 2


# What the engine thread delivers to a request's queue: an output, or the error that ended the request.
_Delivery = RequestOutput | BaseException


class AsyncLLMEngine:
    """Runs `engine.step()` in a dedicated thread; `generate()` streams one request's cumulative outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[_Delivery]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Set when the engine failed for good (a tensor-parallel rank died); `on_failure` is then called
        # on the event loop.
        self.failure: RankFailedError | None = None
        self.on_failure: Callable[[], None] | None = None
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="strata-tokenizer")
        # Written by the engine thread after every step, read anywhere: a snapshot, never the live engine.
        self.stats: dict[str, Any] = engine.stats()

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort whatever is still running, fail its streams with EngineDeadError, and join the thread."""
        self._stopping = True
        if self._thread is None:
            return
        self._inbox.put(("stop", None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.engine.shutdown()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        # A request queued just as the thread stopped was never added: fail it too.
        for deliveries in self._queues.values():
            deliveries.put_nowait(EngineDeadError("the server shut down before the request started"))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and not self._stopping

    # -- requests -------------------------------------------------------------------------------------
    async def run_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer pool, off the event loop (the tokenizer is only ever read)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, functools.partial(fn, *args)
        )

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Validate and tokenise in the caller's thread (read-only), so bad prompts fail before queueing."""
        return self.engine.tokenize_prompt(prompt)

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output each time it advances; the last one has `finished`.

        Leaving the iteration early (the client went away, the task was cancelled) aborts the request in
        the engine, which frees its KV blocks at once.
        """
        if not self.is_running:
            raise EngineDeadError("the server is shutting down")
        text, ids = self.tokenize_prompt(prompt)
        deliveries: asyncio.Queue[_Delivery] = asyncio.Queue()
        self._queues[request_id] = deliveries
        self._inbox.put(("add", (request_id, {"prompt_token_ids": ids, "prompt": text}, params)))
        finished = False
        try:
            while not finished:
                item = await deliveries.get()
                # Outputs are cumulative: a consumer that fell behind only needs the newest one.
                while not deliveries.empty() and isinstance(item, RequestOutput) and not item.finished:
                    item = deliveries.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._inbox.put(("abort", request_id))

    # -- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            # Block only when idle; otherwise take whatever arrived and keep stepping.
            commands = [self._inbox.get()] if not engine.has_unfinished_requests() else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            failures: dict[str, BaseException] = {}
            for kind, payload in commands:
                if kind == "stop":
                    self._stop_all()
                    return
                if kind == "add":
                    request_id, prompt, params = payload
                    try:
                        engine.add_request(prompt, params, request_id)
                    except Exception as exc:  # delivered to the caller, which turns it into a response
                        failures[request_id] = exc
                else:
                    engine.abort_request(payload)
            outputs: list[RequestOutput] = []
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except RankFailedError as exc:  # the engine cannot go on: fail everything and stop
                    logger.error("the engine failed: %s", exc)
                    self._fail(exc)
                    return
                except Exception as exc:
                    logger.exception("engine step failed; failing its requests")
                    for request_id in list(engine.requests):
                        engine.abort_request(request_id)
                        failures[request_id] = exc
            self.stats = engine.stats()
            if outputs or failures:
                self._deliver_threadsafe(outputs, failures)

    def _fail(self, exc: RankFailedError) -> None:
        """The engine broke for good: every request ends with EngineDeadError, `failure` says why, and
        `on_failure` (the server's exit) runs on the event loop."""
        self.failure = exc
        self._stopping = True
        self._stop_all(f"the engine failed: {exc}")
        if self.on_failure is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_failure)

    def _stop_all(self, reason: str = "the server shut down before the request finished") -> None:
        """Abort every request, each ending with EngineDeadError(`reason`)."""
        failures: dict[str, BaseException] = {}
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            failures[request_id] = EngineDeadError(reason)
        self.stats = self.engine.stats()
        self._deliver_threadsafe([], failures)

    def _deliver_threadsafe(self, outputs: list[RequestOutput], failures: dict[str, BaseException]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs, failures)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            logger.debug("event loop closed; dropped %d outputs", len(outputs))

    def _deliver(self, outputs: list[RequestOutput], failures: dict[str, BaseException]) -> None:
        """Runs on the event loop: route each output to its request's queue (gone if the caller left)."""
        for output in outputs:
            deliveries = self._queues.get(output.request_id)
            if deliveries is not None:
                deliveries.put_nowait(output)
        for request_id, exc in failures.items():
            deliveries = self._queues.get(request_id)
            if deliveries is not None:
                deliveries.put_nowait(exc)
