"""Shared fixtures: tiny random models built from transformers' own config classes, and the bundled model."""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from tiny_models import TINY_CONFIGS

# The test models are tiny: a second intra-op thread buys nothing, and when another process holds a core,
# OpenMP barriers waiting for a descheduled thread made the suite 30x slower. One thread keeps it steady.
torch.set_num_threads(1)

# The example plugin is installed into the test environment, and a loaded plugin overrides layers for the
# rest of the process; tests load it only in subprocesses (tests/test_plugins.py) that select it.
os.environ["STRATA_PLUGINS"] = ""

# Compiled pieces go to a private folder (subprocess servers inherit it), never the user's ~/.cache.
os.environ["STRATA_CACHE_ROOT"] = tempfile.mkdtemp(prefix="strata-test-cache-")


@pytest.fixture
def restore_registry() -> Iterator[None]:
    """Layers, implementations, overrides and platforms registered by the test are gone after it."""
    from strata import platforms
    from strata.custom_op import oot_registry, op_registry

    saved = {name: copy.copy(entry) for name, entry in op_registry.items()}
    for entry in saved.values():
        entry.implementations = {
            platform: list(classes) for platform, classes in entry.implementations.items()
        }
    saved_oot, saved_platforms = dict(oot_registry), dict(platforms._platforms)
    yield
    op_registry.clear()
    op_registry.update(saved)
    oot_registry.clear()
    oot_registry.update(saved_oot)
    platforms._platforms.clear()
    platforms._platforms.update(saved_platforms)


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """Sets torch's intra-op thread count for the test and restores it afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_dir("llama")` -> a saved random-weight model folder (built once per session)."""
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            config: PretrainedConfig = TINY_CONFIGS[arch]()
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(folder)
            built[arch] = folder
        return built[arch]

    return build


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    from strata.bundled import default_model

    return Path(default_model())


@pytest.fixture(scope="session")
def shared_models_dir() -> Path:
    """The read-only shared folder beside the checkout, with the original stories260K files."""
    folder = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"
    if not folder.is_dir():
        pytest.skip(f"{folder} is not present")
    return folder
