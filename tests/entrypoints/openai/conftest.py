"""Fixtures of the server tests: the in-process reference `LLM`, a default server, a chat template."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from strata import LLM

from remote_server import CHAT_TEMPLATE, RemoteServer


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The in-process reference the server's outputs are compared with."""
    return LLM()


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    """The bundled model with default options (no chat template, no API key)."""
    remote = RemoteServer()
    yield remote
    assert remote.stop() == 0


@pytest.fixture(scope="module")
def chat_template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path
