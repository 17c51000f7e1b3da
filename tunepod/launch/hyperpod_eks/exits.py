"""How a HyperPod EKS job's pods record their exit codes in the job dir, and how the launcher reads them
(pure but for the file reads).

Kubernetes forgets a finished job: ``ttlSecondsAfterFinished`` deletes its object and pods, after which
the API answers 404 and nothing tells a job that exited 0 from one that failed (an orchestrator that
was down, or slow, past the TTL). Slurm's batch script has an ``EXIT`` trap for that
(``tunepod.launch.exit_code``); a pod has no single script, so tunepod wraps the container's command
(``exit_recorder``): a POSIX shell runs the training command as its child, forwards SIGTERM to it (the
shell is the container's PID 1, which would ignore the signal), and once the child has ended writes
``<exit code> <submission id>`` to ``<job dir>/exit_code.<pod name>`` (temp file, then rename), the pod
name from the downward API (``POD_NAME_ENV``). One file per pod, in the job dir itself (which the
orchestrator owns, so it can always remove an earlier attempt's records, whichever user the pods ran
as); a pod restarted in place overwrites its own record.

``recorded_exit`` judges a job from its pods' records: failed when any pod of the submission recorded
a nonzero code; exited 0 once every pod did; unknown otherwise (a pod killed outright records
nothing: SIGKILL, a lost node). Any record of a submission also proves that its object existed, which
is how the launcher resolves an intent whose object was created, ran and was deleted before its
creation reached the submission record.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from tunepod.launch.exit_code import parse_exit_file

POD_NAME_ENV = "TUNEPOD_POD_NAME"
"""Set in every pod from the downward API (``metadata.name``): the name of its exit record."""
RECORD_PREFIX = "exit_code."
WRAPPER_NAME = "tunepod-exit"
"""``$0`` of the wrapper shell, as ``ps`` shows it."""


def pod_name_env() -> dict[str, Any]:
    """The container env entry that gives the wrapper its pod's name."""
    return {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def record_path(job_dir: Path, pod: str) -> Path:
    """Where pod ``pod`` records its exit code."""
    return job_dir / f"{RECORD_PREFIX}{pod}"


def wrapper_script(job_dir: Path) -> str:
    """The shell script of ``exit_recorder`` (before Kubernetes' ``$`` escaping); its arguments are
    the training command. The script's first line names the job dir, for people and for the
    simulation's twin of the operator."""
    return "\n".join(
        [
            f"tunepod_job_dir={shlex.quote(job_dir.as_posix())}",
            f'record="$tunepod_job_dir/{RECORD_PREFIX}${POD_NAME_ENV}"',
            # PID 1 ignores a signal it has no handler for: forward the pod's SIGTERM to the command.
            "trap 'kill -TERM \"$child\" 2>/dev/null' TERM",
            '"$@" &',
            "child=$!",
            'wait "$child"',
            "code=$?",
            # A trapped signal ends `wait` early (status > 128): wait again until the child is gone.
            'while kill -0 "$child" 2>/dev/null; do wait "$child"; code=$?; done',
            'printf \'%s %s\\n\' "$code" "${TUNEPOD_SUBMISSION_ID:-}" > "$record.tmp" '
            '&& mv -f "$record.tmp" "$record"',
            'exit "$code"',
        ]
    )


def exit_recorder(job_dir: Path) -> list[str]:
    """The container command's prefix that runs the training command and records how it ended (see
    the module docstring); Kubernetes' ``$(VAR)`` expansion is escaped (``$$``)."""
    return ["/bin/sh", "-c", wrapper_script(job_dir).replace("$", "$$"), WRAPPER_NAME]


def recorded_codes(job_dir: Path, submission_id: str) -> list[int]:
    """The exit codes the pods of submission ``submission_id`` recorded, by pod name (none: no pod of
    it ended under the wrapper, or it never ran)."""
    codes = []
    for record in sorted(job_dir.glob(f"{RECORD_PREFIX}*")):
        if record.name.endswith(".tmp"):
            continue
        try:
            parsed = parse_exit_file(record.read_text())
        except (FileNotFoundError, UnicodeDecodeError):
            continue
        if parsed is not None and parsed[1] == submission_id:
            codes.append(parsed[0])
    return codes


def recorded_exit(job_dir: Path, submission_id: str, pods: int) -> int | None:
    """The exit code the ``pods`` pods of submission ``submission_id`` recorded: the first nonzero one
    (by pod name), else 0 once all of them recorded 0; None when that cannot be told."""
    codes = recorded_codes(job_dir, submission_id)
    failed = [code for code in codes if code != 0]
    if failed:
        return failed[0]
    return 0 if pods > 0 and len(codes) >= pods else None


def stale_records(job_dir: Path) -> list[Path]:
    """Every exit record (and temp file) in ``job_dir``: an earlier attempt's, once a new one starts."""
    return sorted(job_dir.glob(f"{RECORD_PREFIX}*"))
