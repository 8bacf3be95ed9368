"""The project as it was at another git revision, for benchmarks that run it beside the current code (`--previous`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def checkout(revision: str, path: Path) -> Path:
    """A git worktree of `revision` at `path` (made once), with its C extensions built in place when it has any."""
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), revision], cwd=REPO, check=True,
                       capture_output=True)
    if (path / "setup.py").exists() and list((path / "loader").rglob("*.c")):
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=path, check=True,
                       capture_output=True)
    return path


def remove(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, check=False)
