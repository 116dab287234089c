"""`EngineClient`: what the server sees of an engine that runs elsewhere (a thread, other processes).

The server handles many HTTP requests at once on one event loop. Each request gets an asyncio queue;
whatever runs the engine hands its outputs and failures to the loop (`deliver_threadsafe`), which routes
them to those queues, and `generate()` reads one. Subclasses say how a request reaches the engine
(`_submit`), how an abandoned one is stopped (`_release`), and how the engine starts and stops.

Tokenizing and detokenizing what clients send (prompts, chat templates, token lists) can take seconds for
large inputs, so callers run it through `run_tokenizer`, on a small thread pool beside the event loop.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from strata.engine.engine_loop import EngineDeadError
from strata.engine.prompts import PromptType
from strata.outputs import RequestOutput
from strata.sampling_params import SamplingParams

logger = logging.getLogger("strata.engine_client")

T = TypeVar("T")

# Threads tokenizing requests at once: enough that one huge prompt does not queue every other request
# behind it, few enough that many huge prompts cannot take every core from the engine.
TOKENIZER_THREADS = 2

# What reaches a request's queue: an output, or the error that ended the request.
_Delivery = RequestOutput | BaseException


class EngineClient(abc.ABC):
    """Per-request output queues on the event loop, the tokenizer pool, and the engine's failure."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._queues: dict[str, asyncio.Queue[_Delivery]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set when the engine failed for good (a tensor-parallel rank or every replica died);
        # `on_failure` (the server's exit) is then called on the event loop.
        self.failure: BaseException | None = None
        self.on_failure: Callable[[], None] | None = None
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="strata-tokenizer")

    # -- what subclasses provide ----------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Start running the engine; outputs are delivered to the running event loop."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort whatever is still running (its streams fail with EngineDeadError) and stop the engine."""

    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """Whether new requests can be served."""

    @property
    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """The engine's latest counters: a snapshot, never the live engine."""

    @abc.abstractmethod
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Validate and tokenize in the caller's thread (read-only), so bad prompts fail before queueing."""

    @abc.abstractmethod
    def _submit(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> None:
        """Hand a tokenized request to the engine."""

    @abc.abstractmethod
    def _release(self, request_id: str, finished: bool) -> None:
        """The caller stopped reading `request_id`; abort it in the engine unless it `finished`."""

    # -- requests -------------------------------------------------------------------------------------
    async def run_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer pool, off the event loop (the tokenizer is only ever read)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, functools.partial(fn, *args)
        )

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
        finished = False
        try:
            self._submit(request_id, {"prompt_token_ids": ids, "prompt": text}, params)
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
            self._release(request_id, finished)

    # -- delivery -------------------------------------------------------------------------------------
    def deliver_threadsafe(self, outputs: list[RequestOutput], failures: dict[str, BaseException]) -> None:
        """From any thread: route `outputs` and `failures` to their requests on the event loop."""
        self.call_soon_threadsafe(self._deliver, outputs, failures)

    def call_soon_threadsafe(self, fn: Callable[..., None], *args: Any) -> None:
        """From any thread: `fn(*args)` on the event loop, unless it is closed (nobody listens any more)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            logger.debug("event loop closed; dropped %s", getattr(fn, "__name__", fn))

    def _deliver(self, outputs: list[RequestOutput], failures: dict[str, BaseException]) -> None:
        """On the event loop: put each output and failure in its request's queue (gone if the caller left)."""
        for output in outputs:
            deliveries = self._queues.get(output.request_id)
            if deliveries is not None:
                deliveries.put_nowait(output)
        for request_id, exc in failures.items():
            deliveries = self._queues.get(request_id)
            if deliveries is not None:
                deliveries.put_nowait(exc)

    def _fail_unstarted(self) -> None:
        """After the engine stopped: a request queued just as it stopped was never added; fail it too."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        for deliveries in self._queues.values():
            deliveries.put_nowait(EngineDeadError("the server shut down before the request started"))

    def _failed(self, exc: BaseException) -> None:
        """From any thread: the engine broke for good; `failure` says why and `on_failure` runs."""
        self.failure = exc
        if self.on_failure is not None:
            self.call_soon_threadsafe(self.on_failure)
