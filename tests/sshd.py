"""The loopback sshd that ``scripts/sshd-up`` starts: is it up, and how tests log in to it.

The daemon listens on 127.0.0.1:2222 only and accepts root's login with the client key kept in its
state dir (``/var/lib/tunepod-sshd``, root only). Logging in to this same host keeps the filesystem
shared, which is what the Slurm launcher's ssh mode requires: the orchestrator and the head node see
the job dirs at the same paths.

A test that needs it calls ``require_sshd()`` (e.g. from an autouse fixture): it skips with the reason
when the daemon is not usable, and fails instead when ``CI=true``, where ``make test`` starts it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from needs import skip_or_fail

SSHD_UP = "scripts/sshd-up"
STATE_DIR = Path("/var/lib/tunepod-sshd")
CLIENT_KEY = STATE_DIR / "client_ed25519"
LOG_FILE = STATE_DIR / "sshd.log"
HOST = "127.0.0.1"
PORT = 2222
TARGET = f"root@{HOST}"


def ssh_options(port: int = PORT) -> list[str]:
    """ssh arguments that reach the test sshd on ``port`` with its client key.

    Host key checking is off: the host key is made on the fly by ``sshd-up``, and writing it to the
    user's known_hosts would leave traces outside the test.
    """
    return [
        "-p", str(port),
        "-i", str(CLIENT_KEY),
        "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null",
        # Without it every call prints "Warning: Permanently added ..." to stderr.
        "-o", "LogLevel=ERROR",
    ]  # fmt: skip


def sshd_available() -> str | None:
    """None when ``ssh root@127.0.0.1 -p 2222 true`` works, else why the test sshd is not usable."""
    if shutil.which("ssh") is None:
        return f"no ssh client on PATH; start the test sshd with {SSHD_UP}"
    if not os.access(CLIENT_KEY, os.R_OK):
        return f"no readable client key {CLIENT_KEY}; start the test sshd with {SSHD_UP} (as root)"
    argv = ["ssh", *ssh_options(), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", TARGET, "true"]
    try:
        login = subprocess.run(
            argv, capture_output=True, text=True, timeout=15, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired:
        return f"ssh {TARGET} -p {PORT} did not answer within 15 s; see {LOG_FILE}"
    if login.returncode != 0:
        return (
            f"ssh {TARGET} -p {PORT} failed (exit {login.returncode}): {login.stderr.strip()}; "
            f"start it with {SSHD_UP}, logs in {LOG_FILE}"
        )
    return None


@functools.cache
def _cached_sshd_available() -> str | None:
    # Asked once per session: the daemon is not expected to come or go during a run.
    return sshd_available()


def require_sshd() -> None:
    """Skip the calling test when the test sshd is not usable; fail it instead when ``CI=true``."""
    reason = _cached_sshd_available()
    if reason is None:
        return
    skip_or_fail(f"the test sshd is not up: {reason}")
