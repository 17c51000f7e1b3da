"""The command a local job runs (pure): ``torchrun --standalone`` inside a shell that records its exit.

A job of one process skips torchrun (unless the spec asks for it): the interpreter runs the entrypoint
with the variables torchrun would have set. torchrun's agent costs seconds per job on a small machine
(it imports torch, starts a rendezvous store and tears it down), more than many tuning trials train.

The wrapper writes ``<exit code> <submission id>`` to ``JobPaths.exit_code`` (temp file, then rename)
once the command has exited (``tunepod.launch.exit_code``), so the outcome can be read by anyone later,
including an orchestrator that restarted and was never the parent of the job.
"""

from __future__ import annotations

from tunepod.launch.base import SINGLE_PROCESS_ENV, JobSpec
from tunepod.launch.exit_code import temp_exit_file
from tunepod.launch.paths import JobPaths

# "$1"/"$2"/"$3" are the exit-code paths and the submission id, the rest is the command: passed as
# arguments, nothing is quoted. The trap has a handler (not ""), so the shell outlives a cancel's
# SIGTERM and still records the exit code, while the command itself gets default signal handling back.
# `command -p` finds mv even if the job's environment replaced PATH.
_WRAPPER_SCRIPT = """trap : TERM INT
exit_tmp=$1
exit_final=$2
submission=$3
shift 3
"$@"
code=$?
printf '%s %s\\n' "$code" "$submission" > "$exit_tmp" && command -p mv -f "$exit_tmp" "$exit_final"
exit "$code"
"""


def job_argv(job: JobSpec, python: str, *, direct_single_process: bool = True) -> list[str]:
    """The command that runs ``job`` here: the interpreter itself for one process (when
    ``direct_single_process``), else torchrun."""
    if direct_single_process and job.resources.procs_per_node == 1:
        return direct_argv(job, python)
    return torchrun_argv(job, python)


def direct_argv(job: JobSpec, python: str) -> list[str]:
    """One process without torchrun: ``env`` sets torchrun's variables, then execs the interpreter.
    An absolute ``env``: the job's environment may replace PATH."""
    variables = [f"{name}={value}" for name, value in SINGLE_PROCESS_ENV.items()]
    return ["/usr/bin/env", *variables, python, str(job.entrypoint), *job.args]


def torchrun_argv(job: JobSpec, python: str) -> list[str]:
    """The command that runs ``job`` on this machine: ``procs_per_node`` processes under torchrun."""
    nproc = str(job.resources.procs_per_node)
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc]
    return [*command, str(job.entrypoint), *job.args]


def wrapper_argv(paths: JobPaths, command: list[str], submission_id: str) -> list[str]:
    """``command`` wrapped in the shell that records its exit code under ``paths``."""
    exit_tmp = temp_exit_file(paths)
    return [
        "/bin/sh",
        "-c",
        _WRAPPER_SCRIPT,
        "tunepod-job",
        exit_tmp,
        str(paths.exit_code),
        submission_id,
        *command,
    ]
