"""The model shipped inside the package, so `strata generate` and the tests work without any download."""

from __future__ import annotations

from pathlib import Path

BUNDLED_MODEL_DIR: Path = Path(__file__).resolve().parent / "model_data" / "stories260K"


def default_model() -> str:
    """Path of the bundled stories260K Hugging Face folder (converted from llama2.c's release)."""
    return str(BUNDLED_MODEL_DIR)
