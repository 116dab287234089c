"""The package's layout holds: imports point down, and only `strata.platforms` knows about device types.

Read from the sources (ast), so a new upward import or a device check outside a platform fails here, with
the file and line, instead of going unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "strata"

# Package -> the strata packages it must not import (each folder one idea; imports point down).
FORBIDDEN = {
    "strata.custom_op": ["strata."],
    "strata.atomic_file": ["strata."],
    # The GGUF package spans levels: the file reader and the quant math sit at the bottom (the GGUF layers
    # compute with them), the weight pairing at the models' level, the converter above strata.converters.
    "strata.gguf.file": ["strata."],
    "strata.gguf.quants": ["strata."],
    "strata.gguf": ["strata.engine", "strata.entrypoints", "strata.sample", "strata.worker"],
    "strata.converters": ["strata.engine", "strata.entrypoints", "strata.sample", "strata.worker"],
    "strata.converters.__init__": ["strata.gguf"],  # strata.gguf.converter imports this package
    "strata.platforms.interface": ["strata."],
    "strata.platforms.__init__": ["strata.attention", "strata.compilation", "strata.engine", "strata.models"],
    "strata.platforms": ["strata.engine", "strata.worker", "strata.entrypoints", "strata.models", "strata.sample"],
    "strata.hw_agnostic": [
        "strata.attention", "strata.compilation", "strata.engine", "strata.entrypoints", "strata.gguf.converter",
        "strata.gguf.weights", "strata.models", "strata.platforms", "strata.sample", "strata.worker",
    ],
    "strata.attention": [
        "strata.compilation.backend", "strata.compilation.compiler", "strata.compilation.passes",
        "strata.engine", "strata.entrypoints", "strata.hw_agnostic", "strata.models", "strata.platforms",
        "strata.sample", "strata.worker",
    ],
    "strata.compilation": [
        "strata.attention", "strata.engine", "strata.entrypoints", "strata.hw_agnostic", "strata.models",
        "strata.sample", "strata.worker",
    ],
    "strata.sample": [
        "strata.attention", "strata.compilation", "strata.engine", "strata.entrypoints", "strata.hw_agnostic",
        "strata.models", "strata.platforms", "strata.worker",
    ],
    "strata.structured_output": [
        "strata.attention", "strata.compilation", "strata.engine", "strata.entrypoints", "strata.hw_agnostic",
        "strata.models", "strata.platforms", "strata.worker",
    ],
    "strata.distributed": [
        "strata.attention", "strata.compilation", "strata.engine", "strata.entrypoints", "strata.hw_agnostic",
        "strata.models", "strata.platforms", "strata.sample", "strata.worker",
    ],
    "strata.models": ["strata.engine", "strata.entrypoints", "strata.sample", "strata.worker"],
    "strata.worker": ["strata.engine", "strata.entrypoints", "strata.sample"],
    "strata.engine": ["strata.entrypoints"],
    # Shared by every level, beside config.py: it builds configs, nothing that runs them.
    "strata.engine_args": ["strata.engine.", "strata.entrypoints", "strata.worker", "strata.models"],
}  # fmt: skip

DEVICE_NAMES = {"cpu", "cuda", "mps", "xpu", "hpu", "npu"}


def _modules() -> list[tuple[str, Path]]:
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules.append((".".join(parts), path))
    return modules


def _imports(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
    return found


def _rules(module: str) -> list[str]:
    """The forbidden prefixes of every rule whose package holds `module` (the most specific ones too)."""
    return [
        prefix
        for package, prefixes in FORBIDDEN.items()
        if module == package or module.startswith(package + ".")
        for prefix in prefixes
    ]


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_imports_point_down(module: str, path: Path) -> None:
    rules = _rules(module)
    upward = [
        f"{path.name}:{line}: {name}"
        for name, line in _imports(ast.parse(path.read_text()))
        if any(name.startswith(prefix) and not name.startswith(module) for prefix in rules)
    ]
    assert not upward, f"{module} imports above its layer: {upward}"


def _is_device_type(node: ast.expr) -> bool:
    """`<...>.device.type` or `<device>.type`."""
    if not (isinstance(node, ast.Attribute) and node.attr == "type"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "device") or (
        isinstance(owner, ast.Name) and "device" in owner.id
    )


def _device_checks(tree: ast.AST) -> list[int]:
    """Lines that compare with a device name or a `.device.type`, or use `torch.cuda`."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names = any(isinstance(o, ast.Constant) and o.value in DEVICE_NAMES for o in operands)
            types = any(_is_device_type(o) for o in operands)
            if names or types:
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "cuda"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return lines


def test_only_platforms_branch_on_a_device_type() -> None:
    found = {
        module: lines
        for module, path in _modules()
        if not module.startswith("strata.platforms.")
        and (lines := _device_checks(ast.parse(path.read_text())))
    }
    assert found == {}


def test_the_checks_see_what_they_look_for() -> None:
    """The two checks on code that breaks them (so an empty result above means something)."""
    code = ast.parse(
        "import strata.engine.llm_engine\nif x.device.type == 'cpu':\n    y = torch.cuda.is_available()\n"
    )
    assert _device_checks(code) == [2, 3]
    assert _imports(code)[0] == ("strata.engine.llm_engine", 1)
    assert "strata.engine" in _rules("strata.worker.model_runner")
