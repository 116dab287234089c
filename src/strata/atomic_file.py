"""Writing a file so that readers see the whole of it or nothing: caches shared by concurrent processes
(compiled pieces, kernels, Inductor's record) and converted model folders all write this way."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_atomically(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` to a private path beside `path`, then rename it onto `path` (atomic within one folder);
    when `write` fails, the partial file is removed and `path` stays as it was. `write` creates the file
    itself, so it gets the permissions any new file gets."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
