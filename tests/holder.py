"""A child Python process that takes something (a lock, a lease) and holds it until the test kills it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def hold(take: str) -> subprocess.Popen[bytes]:
    """Runs ``take`` (Python, with ``Path`` imported and the repository importable) in a child, and
    returns once it has run; the child then sleeps until killed."""
    code = "\n".join(
        [
            "import sys, time",
            f"sys.path.insert(0, {str(REPO)!r})",
            "from pathlib import Path",
            textwrap.dedent(take),
            'print("held", flush=True)',
            "time.sleep(600)",
        ]
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n", "the child never took it"
    return holder
