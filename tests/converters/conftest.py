"""Fixtures for the converter tests: the real stories260K sources and their conversions."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.converters import convert_llama2c
from strata.gguf.converter import convert_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def shared_models_dir() -> Path:
    """`../shared/models/stories260K` beside the checkout; the tests that need it skip without it."""
    path = REPO_ROOT.parent / "shared" / "models" / "stories260K"
    if not (path / "stories260K.bin").is_file():
        pytest.skip(f"the shared stories260K sources are not at {path}")
    return path


@pytest.fixture(scope="session")
def llama2c_folder(shared_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("from_llama2c") / "model"
    return convert_llama2c(shared_models_dir / "stories260K.bin", shared_models_dir / "tok512.bin", out)


@pytest.fixture(scope="session")
def gguf_folder(shared_models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_gguf(
        shared_models_dir / "stories260K.gguf", tmp_path_factory.mktemp("from_gguf") / "model"
    )
