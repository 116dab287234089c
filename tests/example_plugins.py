"""The example plugins of examples/, installed as a user would install them, each into a folder of its own.

Installing one into the test venv itself would make it override the layers of every later `strata`
command run there (`make run` included); a separate site folder on PYTHONPATH keeps it to the subprocesses
given its environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def install_example(package: str, plugin: str, site: Path) -> dict[str, str]:
    """`examples/<package>` pip-installed into `site`; returns the environment that loads it (and only it)
    as plugin `plugin`."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(EXAMPLES / package),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return {**os.environ, "STRATA_PLUGINS": plugin, "PYTHONPATH": str(site)}
