"""The server's own OpenAPI schema, fuzzed by schemathesis: whatever it generates, no answer is a 5xx.

The run is bounded (a few dozen cases per operation, a small context and few sequences per request) so
it stays under a minute on the bundled model. Hypothesis drives each operation's strategy directly, as
schemathesis' pytest plugin does not load under this pytest."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from remote_server import RemoteServer

CASES_PER_OPERATION = 30


@pytest.fixture(scope="module")
def schema_server() -> Iterator[RemoteServer]:
    remote = RemoteServer("--max-model-len", "64", "--max-sequences-per-request", "4")
    yield remote
    assert remote.stop() == 0


def test_openapi_schema_is_served(schema_server: RemoteServer) -> None:
    document = httpx.get(f"{schema_server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}"} <= set(document["paths"])


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=lambda mode: mode.value)
def test_no_generated_request_gets_a_5xx(
    schema_server: RemoteServer, mode: schemathesis.GenerationMode
) -> None:
    """Valid requests (positive) and requests that break the schema (negative) alike."""
    schema = schemathesis.openapi.from_url(f"{schema_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    statuses: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy(mode))
        @settings(
            max_examples=CASES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def no_5xx(case: schemathesis.Case) -> None:
            response = case.call(base_url=schema_server.url, timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (
                f"{case.as_curl_command()}\n{response.status_code} {response.text[:500]}"
            )

        try:
            no_5xx()
        except Unsatisfiable:  # an operation without inputs (GET /health) has no invalid request
            assert mode is schemathesis.GenerationMode.NEGATIVE
    assert len(statuses) >= 4 * len(operations)
