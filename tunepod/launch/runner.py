"""The seam between a launcher and the commands it runs: here (``LocalRunner``) or over ssh (``SshRunner``).

A cluster launcher never calls ``subprocess`` itself: it hands an argv to a ``CommandRunner`` and gets
the finished process back, or an exception that says what failed and whether retrying can help.

- ``CommandFailed``: the command ran and exited non-zero, or could not be started; retrying repeats it.
- ``TransientCommandFailed`` (also a ``tunepod.errors.TransientError``): ssh could not reach the host,
  the Slurm controller did not answer, or the command outlived its timeout; the same call may work a
  moment later.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tunepod.errors import TransientError, TunepodError

SSH_CONNECTION_FAILED = 255
"""ssh's own exit code when it cannot connect or authenticate; the remote command never ran."""
COMMAND_NOT_FOUND = 127

# What Slurm's clients print when the controller is busy, restarting or failing over: worth a retry.
_TRANSIENT_STDERR = re.compile(
    r"Socket timed out|Unable to contact slurm controller|Connection refused|"
    r"Zero Bytes were transmitted or received|slurm_load_jobs error: Slurm backup controller in standby",
    re.IGNORECASE,
)
_STDERR_IN_MESSAGE_CHARS = 2000


class CommandFailed(TunepodError):
    """A command exited non-zero (or could not start). Carries what a runbook needs."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, why: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        status = why or f"exited with code {returncode}"
        detail = stderr.strip()[-_STDERR_IN_MESSAGE_CHARS:]
        super().__init__(f"`{shlex.join(self.argv)}` {status}" + (f"; stderr:\n{detail}" if detail else ""))


class TransientCommandFailed(CommandFailed, TransientError):
    """A command failed in a way a retry can fix (unreachable host, busy controller, timeout)."""


@runtime_checkable
class CommandRunner(Protocol):
    """Runs one command to completion. Implementations are thread safe: each call is independent."""

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` with ``input`` on stdin; return it once it exited 0, else raise ``CommandFailed``."""
        ...


def is_transient_failure(returncode: int, stderr: str, *, over_ssh: bool = False) -> bool:
    """Whether a command that exited ``returncode`` with ``stderr`` is worth retrying as is (pure)."""
    if over_ssh and returncode == SSH_CONNECTION_FAILED:
        return True
    return bool(_TRANSIENT_STDERR.search(stderr))


class LocalRunner:
    """Runs commands on this machine with ``subprocess`` (no shell: the argv is passed as is)."""

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return _run_checked(argv, input=input, timeout_s=timeout_s, over_ssh=False)


class SshRunner:
    """Runs commands on ``target`` (``user@host``) over ssh; stdin is forwarded (sbatch reads its script).

    The remote side gets one shell-quoted string, so arguments with spaces or quotes arrive intact.
    ``BatchMode=yes`` makes a missing key fail at once instead of waiting for a password prompt.
    """

    def __init__(self, target: str, options: Sequence[str] = ()) -> None:
        self.target = target
        self.options = list(options)

    def ssh_argv(self, argv: Sequence[str]) -> list[str]:
        """The local argv that runs ``argv`` on the target (pure)."""
        # ssh keeps the first value it gets for an option: the user's options go first so they win.
        return ["ssh", *self.options, "-o", "BatchMode=yes", self.target, "--", shlex.join(argv)]

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return _run_checked(self.ssh_argv(argv), input=input, timeout_s=timeout_s, over_ssh=True)


def _run_checked(
    argv: Sequence[str], *, input: str | None, timeout_s: float, over_ssh: bool
) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            # Without input, the command must not inherit (and block on) the orchestrator's stdin.
            stdin=subprocess.DEVNULL if input is None else None,
            check=False,
        )
    except FileNotFoundError:
        raise CommandFailed(
            argv, COMMAND_NOT_FOUND, "", why=f"could not start: {argv[0]!r} is not on PATH"
        ) from None
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise TransientCommandFailed(argv, None, stderr, why=f"timed out after {timeout_s:g}s") from None
    if done.returncode != 0:
        error = (
            TransientCommandFailed
            if is_transient_failure(done.returncode, done.stderr, over_ssh=over_ssh)
            else CommandFailed
        )
        raise error(argv, done.returncode, done.stderr)
    return done
