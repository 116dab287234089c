"""The design notes name only what exists, and every package says what it holds.

`docs/architecture.md` is where a newcomer learns which file holds what; a module renamed or moved without
it leaves the note pointing at nothing. The checks read the note's package tree, its backticked paths and
its dotted `strata.` names, and resolve each against `src/strata` (or the repository, for `examples/...`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "strata"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# A file or folder name as the note writes it: `engine/scheduler.py`, `openai/`, `serving*.py`.
_PATH = re.compile(r"^(?:[\w*.-]+/)*[\w*-]+(?:\.py|/)$|^(?:[\w*.-]+/)+[\w*.-]+$")
_FILE_IN_TEXT = re.compile(r"(?<![\w/.])((?:\w+/)*\w+\.py|(?:\w+/)+)(?![\w/])")
_DOTTED = re.compile(r"(?<![\w.])strata(?:\.\w+)+")


def _exists(name: str, base: Path) -> bool:
    """Whether `name` (a path that may hold `*`) is a file or folder under `base`."""
    return any(base.glob(name.rstrip("/"))) if "*" in name else (base / name.rstrip("/")).exists()


def _resolves(name: str, base: Path = PACKAGE) -> bool:
    """A path under `base`, else under the repository; a bare file name anywhere in the package."""
    if "/" not in name.rstrip("/"):
        return _exists(name, base) or any(PACKAGE.rglob(name.rstrip("/")))
    return _exists(name, base) or _exists(name, ROOT)


def _module_has(dotted: str) -> bool:
    """`strata.a.b` is a module or package, or a name its longest importable prefix defines or imports."""
    parts = dotted.split(".")[1:]
    for cut in range(len(parts), -1, -1):
        path = PACKAGE.joinpath(*parts[:cut])
        source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if source.is_file():
            rest = parts[cut:]
            return not rest or (len(rest) == 1 and re.search(rf"\b{rest[0]}\b", source.read_text()) is not None)
    return False


def _tree_names(text: str) -> list[str]:
    """The paths the package tree (the code block that starts with `src/strata/`) names: each line's first
    column (a package folder, or files at the top), and the file and folder names its description gives,
    relative to that line's package (a line indented further continues the one above)."""
    block = re.search(r"```\n(src/strata/\n.*?)```", text, re.S)
    if block is None:
        return []
    names, package = [], ""
    for line in block.group(1).splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        description = line.strip()
        if indent <= 2:  # a new entry: its first column, items joined by commas
            first, *rest = description.split()
            column = [first]
            while column[-1].endswith(",") and rest:
                column.append(rest.pop(0))
            column = [item.rstrip(",") for item in column]
            names.extend(column)
            package = column[0] if column[0].endswith("/") else ""
            description = " ".join(rest)
        names.extend(package + found for found in _FILE_IN_TEXT.findall(description))
    return names


def _backticked_paths(text: str) -> list[str]:
    """The paths written in backticks; placeholders like `platforms/<name>/` are skipped."""
    return [span for span in re.findall(r"`([^`\n]+)`", text) if _PATH.match(span)]


def missing_names(text: str) -> list[str]:
    """Every module, file or folder of the package that `text` names and that does not exist."""
    return (
        [name for name in _tree_names(text) if not _exists(name, PACKAGE)]
        + [name for name in _backticked_paths(text) if not _resolves(name)]
        + [name for name in _DOTTED.findall(text) if not _module_has(name)]
    )


def test_architecture_names_only_what_exists() -> None:
    text = ARCHITECTURE.read_text()
    assert _tree_names(text), "the package tree (a code block starting with src/strata/) was not found"
    assert missing_names(text) == []


def test_the_check_sees_what_it_looks_for() -> None:
    """Names that do not exist, written each way the note writes names, are all found (so an empty result
    above means something); names that exist are not."""
    text = """
```
src/strata/
  engine/        LLMEngine (llm_engine.py), the step planner (planner.py)
                 and the rest (no_such_module.py)
  nowhere/       nothing
  config.py, gone.py  shared by every level
```
`worker/model_runner.py` runs the step, `worker/ranks_of_old.py` did; see `strata.engine.scheduler`,
`strata.engine.no_scheduler`, strata.platforms.Platform and strata.platforms.NoSuchPlatform; `serving*.py`.
"""
    assert sorted(missing_names(text)) == sorted(
        [
            "engine/planner.py",
            "engine/no_such_module.py",
            "nowhere/",
            "gone.py",
            "worker/ranks_of_old.py",
            "strata.engine.no_scheduler",
            "strata.platforms.NoSuchPlatform",
        ]
    )


def _packages() -> list[Path]:
    return sorted(path.parent for path in PACKAGE.rglob("__init__.py"))


@pytest.mark.parametrize("package", _packages(), ids=lambda path: str(path.relative_to(PACKAGE.parent)))
def test_every_package_says_what_it_holds(package: Path) -> None:
    assert ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
