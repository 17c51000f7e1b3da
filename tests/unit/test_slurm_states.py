"""Every Slurm job state mapped onto ``JobState``, the parsers of squeue/scontrol/sacct output, the
state cache's fallback when the controller does not answer, and the command runner underneath.

The parsers are fed lines as Slurm 22.05 prints them (copied from the local test cluster).
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from collections.abc import Sequence

import pytest

from tunepod.errors import TransientError, TunepodError, is_transient
from tunepod.launch.base import JobState
from tunepod.launch.runner import (
    CommandFailed,
    CommandRunner,
    LocalRunner,
    SshRunner,
    TransientCommandFailed,
    is_transient_failure,
)
from tunepod.launch.slurm import (
    SLURM_STATES,
    SlurmStateCache,
    SlurmStatus,
    map_slurm_state,
    parse_exit_code,
    parse_job_id,
    parse_sacct,
    parse_scontrol_job,
    parse_squeue,
)

# Every state in squeue(1) "JOB STATE CODES" (Slurm 22.05), with the JobState it must map to.
EXPECTED = {
    "PENDING": JobState.PENDING,
    "CONFIGURING": JobState.PENDING,
    "REQUEUED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING,
    "REQUEUE_FED": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING,
    "SPECIAL_EXIT": JobState.PENDING,
    "PREEMPTED": JobState.PENDING,
    "RESIZING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "REVOKED": JobState.FAILED,
    "CANCELLED": JobState.CANCELLED,
}

SCONTROL_FAILED = (
    "JobId=28 JobName=t.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901732 Nice=0 "
    "Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0 RunTime=00:00:00 TimeLimit=UNLIMITED "
    "NodeList=vm BatchHost=vm Command=/tmp/sq/t.sh WorkDir=/tmp/sq StdErr=/tmp/sq/o 28 #x.log Power= \n"
)


@pytest.mark.parametrize(("slurm_state", "expected"), sorted(EXPECTED.items()))
def test_every_slurm_state_maps(slurm_state: str, expected: JobState) -> None:
    assert map_slurm_state(slurm_state) is expected


def test_the_table_covers_exactly_the_documented_states() -> None:
    assert set(SLURM_STATES) == set(EXPECTED)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("CANCELLED by 1000", JobState.CANCELLED),
        ("running", JobState.RUNNING),
        ("COMPLETED+", JobState.SUCCEEDED),
    ],
)
def test_state_spellings_of_sacct_and_squeue(text: str, expected: JobState) -> None:
    assert map_slurm_state(text) is expected


def test_unknown_state_is_running_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tunepod.launch.slurm")
    assert map_slurm_state("LAUNCHED_ON_MARS") is JobState.RUNNING
    assert map_slurm_state("LAUNCHED_ON_MARS") is JobState.RUNNING
    warnings = [r.getMessage() for r in caplog.records if "LAUNCHED_ON_MARS" in r.getMessage()]
    assert len(warnings) == 1


def test_parse_squeue_keeps_reasons_with_spaces_and_bars() -> None:
    out = "28|PENDING|Priority\n29|PENDING|ReqNodeNotAvail, UnavailableNodes:vm|x\n30|RUNNING|None\n\n"
    assert parse_squeue(out) == {
        "28": SlurmStatus("PENDING", "Priority"),
        "29": SlurmStatus("PENDING", "ReqNodeNotAvail, UnavailableNodes:vm|x"),
        "30": SlurmStatus("RUNNING", "None"),
    }


def test_parse_scontrol_reads_state_reason_and_exit_code() -> None:
    assert parse_scontrol_job(SCONTROL_FAILED) == SlurmStatus("FAILED", "NonZeroExitCode", 3, 0)


def test_parse_scontrol_is_not_fooled_by_the_job_name() -> None:
    tricked = SCONTROL_FAILED.replace("JobName=t.sh", "JobName=x JobState=COMPLETED ExitCode=0:0")
    assert parse_scontrol_job(tricked) == SlurmStatus("FAILED", "NonZeroExitCode", 3, 0)


def test_parse_scontrol_without_a_state_is_none() -> None:
    assert parse_scontrol_job("") is None


@pytest.mark.parametrize(
    ("text", "expected"), [("3:0", (3, 0)), ("0:9", (0, 9)), ("0", (0, 0)), ("x", (None, None))]
)
def test_parse_exit_code(text: str, expected: tuple[int | None, int | None]) -> None:
    assert parse_exit_code(text) == expected


def test_parse_sacct() -> None:
    assert parse_sacct("CANCELLED by 0|0:15|None\n") == SlurmStatus("CANCELLED by 0", "None", 0, 15)
    assert parse_sacct("") is None


def test_parse_job_id_of_sbatch_parsable() -> None:
    assert parse_job_id("4412\n") == "4412"
    assert parse_job_id("4412;tunepod\n") == "4412"
    with pytest.raises(TunepodError, match="not a job id"):
        parse_job_id("sbatch: error: Batch job submission failed\n")


def test_describe_is_a_runbook_line() -> None:
    assert SlurmStatus("FAILED", "NonZeroExitCode", 3, 0).describe("7") == (
        "slurm job 7 FAILED (reason NonZeroExitCode, exit code 3)"
    )
    assert (
        SlurmStatus("CANCELLED", "None", 0, 9).describe("7") == "slurm job 7 CANCELLED (killed by signal 9)"
    )


class OutageRunner:
    """Slurm's clients as seen during a controller outage: a stand-in, because stopping the shared test
    cluster's slurmctld mid-test would break every other test using it."""

    def __init__(self) -> None:
        self.down = False
        self.calls: list[list[str]] = []

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        if self.down:
            raise TransientCommandFailed(argv, 1, "slurm_load_jobs error: Unable to contact slurm controller")
        return subprocess.CompletedProcess(list(argv), 0, stdout="5|RUNNING|None\n", stderr="")


def test_cache_serves_the_last_state_while_the_controller_is_briefly_down() -> None:
    runner = OutageRunner()
    assert isinstance(runner, CommandRunner)
    cache = SlurmStateCache(runner, max_age_s=0, stale_limit_s=3600)
    assert cache.status("5").job_state is JobState.RUNNING
    runner.down = True
    assert cache.status("5").job_state is JobState.RUNNING
    assert len(runner.calls) == 2  # it did ask again


def test_cache_raises_once_the_outage_outlasts_the_stale_limit() -> None:
    runner = OutageRunner()
    cache = SlurmStateCache(runner, max_age_s=0, stale_limit_s=0)
    cache.status("5")
    runner.down = True
    with pytest.raises(TransientError, match="Unable to contact slurm controller"):
        cache.status("5")


def test_cache_raises_when_there_is_no_last_state() -> None:
    runner = OutageRunner()
    runner.down = True
    with pytest.raises(TransientError):
        SlurmStateCache(runner, max_age_s=0).status("5")


# ---------------------------------------------------------------------------------------------- runner


def test_local_runner_runs_for_real_with_stdin() -> None:
    done = LocalRunner().run(
        [sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"], input="hi"
    )
    assert done.stdout == "HI\n"


def test_local_runner_failure_carries_command_code_and_stderr() -> None:
    argv = ["sh", "-c", "echo 'sbatch: error: invalid partition' >&2; exit 1"]
    with pytest.raises(CommandFailed) as failure:
        LocalRunner().run(argv)
    assert failure.value.returncode == 1
    assert "invalid partition" in failure.value.stderr
    assert "exited with code 1" in str(failure.value)
    assert "sh -c" in str(failure.value)
    assert not is_transient(failure.value)


def test_local_runner_missing_binary_is_not_transient() -> None:
    with pytest.raises(CommandFailed, match="not on PATH") as failure:
        LocalRunner().run(["tunepod-no-such-binary"])
    assert not isinstance(failure.value, TransientError)


def test_local_runner_controller_timeout_is_transient() -> None:
    argv = ["sh", "-c", "echo 'squeue: error: slurm_receive_msg: Socket timed out on send/recv' >&2; exit 1"]
    with pytest.raises(TransientCommandFailed) as failure:
        LocalRunner().run(argv)
    assert is_transient(failure.value)


def test_local_runner_timeout_is_transient() -> None:
    with pytest.raises(TransientCommandFailed, match=r"timed out after 0\.2s"):
        LocalRunner().run(["sleep", "30"], timeout_s=0.2)


@pytest.mark.parametrize(
    ("code", "stderr", "over_ssh", "transient"),
    [
        (255, "ssh: connect to host head port 22: Connection timed out", True, True),
        (255, "", False, False),
        (1, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)", False, True),
        (1, "sbatch: error: Batch job submission failed: Invalid account", True, False),
    ],
)
def test_which_failures_are_transient(code: int, stderr: str, over_ssh: bool, transient: bool) -> None:
    assert is_transient_failure(code, stderr, over_ssh=over_ssh) is transient


def test_ssh_argv_quotes_the_remote_command_once() -> None:
    runner = SshRunner("ubuntu@head", ["-o", "ProxyCommand=aws ssm start-session --target %h"])
    remote = ["sbatch", "--parsable", "/fsx/jobs/it's a dir/job.sbatch"]
    argv = runner.ssh_argv(remote)
    proxy = "ProxyCommand=aws ssm start-session --target %h"
    assert argv[:-1] == ["ssh", "-o", proxy, "-o", "BatchMode=yes", "ubuntu@head", "--"]
    # The remote shell splits the last word back into exactly the argv we meant.
    assert shlex.split(argv[-1]) == remote
