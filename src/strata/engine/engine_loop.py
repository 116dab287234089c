"""The loop that drives one `LLMEngine` for a server: apply the adds and aborts that arrived, step while any
request is unfinished (so requests that arrive while others run join the same forward passes), and hand
each step's outputs and per-request failures on.

`AsyncLLMEngine` runs it on a thread of the server's process, a data-parallel replica in a process of its
own; they differ only in where commands come from and where outputs go, which the caller passes in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from strata.engine.llm_engine import LLMEngine
from strata.outputs import RequestOutput
from strata.worker.ranks import RankFailedError

logger = logging.getLogger("strata.engine_loop")

# A command for the loop: ("add", (request_id, prompt, params)), ("abort", request_id) or ("stop", None).
Command = tuple[str, Any]
# `receive(block)`: the commands that arrived; with `block`, waits for at least one (the engine is idle).
Receive = Callable[[bool], list[Command]]
# `deliver(outputs, failures)`: after every pass of the loop, what it produced (possibly nothing).
Deliver = Callable[[list[RequestOutput], dict[str, BaseException]], None]

SHUTDOWN_REASON = "the server shut down before the request finished"


class EngineDeadError(RuntimeError):
    """The engine is shutting down or stopped: the request cannot be (or was not) completed."""


def run_engine_loop(engine: LLMEngine, receive: Receive, deliver: Deliver) -> RankFailedError | None:
    """Serve commands until "stop" (returns None) or the engine fails for good (a tensor-parallel rank
    died: returns the error). Either way every unfinished request ends with an EngineDeadError."""
    while True:
        commands = receive(not engine.has_unfinished_requests())
        failures: dict[str, BaseException] = {}
        for kind, payload in commands:
            if kind == "stop":
                deliver([], abort_all(engine, SHUTDOWN_REASON))
                return None
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
                deliver([], abort_all(engine, f"the engine failed: {exc}"))
                return exc
            except Exception as exc:
                logger.exception("engine step failed; failing its requests")
                for request_id in list(engine.requests):
                    engine.abort_request(request_id)
                    failures[request_id] = exc
        deliver(outputs, failures)


def abort_all(engine: LLMEngine, reason: str) -> dict[str, BaseException]:
    """Abort every request of `engine`; each one's failure is EngineDeadError(`reason`)."""
    failures: dict[str, BaseException] = {}
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
        failures[request_id] = EngineDeadError(reason)
    return failures
