"""Every Slurm job state mapped onto ``JobState``, the parsers of squeue/scontrol/sacct output, the
launcher's state fallback when the controller does not answer, how ``find`` picks a submission's job
out of Slurm's listings, and the command runner underneath.

The parsers are fed lines as Slurm 22.05 prints them (copied from the local test cluster).
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tunepod.errors import TransientError, TunepodError, is_transient
from tunepod.launch.base import JobState
from tunepod.launch.paths import JobPaths
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
    SlurmLauncher,
    SlurmStatus,
    map_slurm_state,
    parse_exit_code,
    parse_job_id,
    parse_job_listing,
    parse_sacct,
    parse_scontrol_job,
    parse_squeue,
)
from tunepod.launch.slurm.launcher import ELASTIC_NODES_DETAIL, recorded_status
from tunepod.launch.slurm.render import exit_code_trap
from tunepod.launch.slurm.states import ListedJob
from tunepod.launch.status_cache import TrackedJob
from tunepod.launch.submission import Submission
from tunepod.spec.models import SlurmLauncherSpec

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

#: squeue's start time (``%S``) of a running job.
STARTED = "2026-12-07T12:00:00"
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
    out = (
        "28|PENDING|2|n/a||N/A|Priority\n29|PENDING|1|n/a||N/A|ReqNodeNotAvail, UnavailableNodes:vm|x\n"
        f"30|RUNNING|2|n1|n[1-2]|{STARTED}|None\n\n"
    )
    assert parse_squeue(out) == {
        "28": SlurmStatus("PENDING", "Priority", node_count=2),
        "29": SlurmStatus("PENDING", "ReqNodeNotAvail, UnavailableNodes:vm|x", node_count=1),
        "30": SlurmStatus(
            "RUNNING", "None", node_count=2, batch_host="n1", nodelist="n[1-2]", start_time=STARTED
        ),
    }


def test_a_running_jobs_run_mark_is_its_start_time(tmp_path: Path) -> None:
    """A requeue that no look saw (queued and run again between two polls, or while squeue failed)
    shows as another start time; a queued job has no run mark."""
    statuses = parse_squeue(
        f"7|RUNNING|1|n1|n1|{STARTED}|None\n8|PENDING|1|n/a||N/A|BeginTime\n"
        "9|RUNNING|1|n1|n1|2026-12-07T12:05:00|None\n10|RUNNING|1|n1|n1|N/A|None\n"
    )
    launcher = SlurmLauncher(launcher_spec(tmp_path), ScriptedRunner({}))
    marks = {job_id: launcher.run_mark(status) for job_id, status in statuses.items()}
    assert marks == {"7": STARTED, "8": None, "9": "2026-12-07T12:05:00", "10": None}


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


def test_parse_job_listing_keeps_bars_in_names_and_reads_null_as_no_comment() -> None:
    out = "41|tunepod:00ff|trial 7 | a|b\n42|(null)|trial 7\n\n"
    assert parse_job_listing(out) == [
        ListedJob("41", "tunepod:00ff", "trial 7 | a|b"),
        ListedJob("42", "", "trial 7"),
    ]


def launcher_spec(tmp_path: Path) -> SlurmLauncherSpec:
    return SlurmLauncherSpec.model_validate({"kind": "slurm", "root": str(tmp_path), "poll_cache_s": 0})


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


def test_launcher_serves_the_last_state_while_the_controller_is_briefly_down(tmp_path: Path) -> None:
    runner = OutageRunner()
    assert isinstance(runner, CommandRunner)
    handle = SlurmLauncher(launcher_spec(tmp_path), runner, stale_limit_s=3600).attach("5", tmp_path)
    assert handle.state() is JobState.RUNNING
    runner.down = True
    assert handle.state() is JobState.RUNNING
    assert len(runner.calls) == 2  # it did ask again


def test_launcher_raises_once_the_outage_outlasts_the_stale_limit(tmp_path: Path) -> None:
    runner = OutageRunner()
    handle = SlurmLauncher(launcher_spec(tmp_path), runner, stale_limit_s=0).attach("5", tmp_path)
    handle.state()
    runner.down = True
    with pytest.raises(TransientError, match="Unable to contact slurm controller"):
        handle.state()


def test_launcher_raises_when_there_is_no_last_state(tmp_path: Path) -> None:
    runner = OutageRunner()
    runner.down = True
    with pytest.raises(TransientError):
        SlurmLauncher(launcher_spec(tmp_path), runner).attach("5", tmp_path).state()


class ScriptedRunner:
    """Answers each Slurm client (by program name) with fixed output, or a failure, and records argvs."""

    def __init__(self, answers: Mapping[str, str | CommandFailed]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        answer = self.answers.get(argv[0], "")
        if isinstance(answer, CommandFailed):
            raise answer
        return subprocess.CompletedProcess(list(argv), 0, stdout=answer, stderr="")


def intent(name: str = "trial-7", submission_id: str = "00000000000000aa") -> Submission:
    return Submission(
        backend="slurm",
        name=name,
        attempt=2,
        submission_id=submission_id,
        intent_at="2026-03-02T10:00:00+00:00",
    )


NO_ACCOUNTING = CommandFailed(["sacct"], 1, "Slurm accounting storage is disabled")


def test_find_picks_this_submissions_job_among_jobs_of_the_same_name(tmp_path: Path) -> None:
    listing = "40|tunepod:00000000000000ff|trial-7\n41|tunepod:00000000000000aa|trial-7\n42|(null)|trial-7\n"
    runner = ScriptedRunner({"squeue": listing, "sacct": NO_ACCOUNTING})
    found = SlurmLauncher(launcher_spec(tmp_path), runner).find(intent(), tmp_path)
    assert found is not None and found.job_id == "41"
    assert runner.calls == [["squeue", "-h", "--states=all", "--name=trial-7", "-o", "%i|%k|%j"]]


def test_find_without_a_match_and_without_accounting_is_none(tmp_path: Path) -> None:
    runner = ScriptedRunner({"squeue": "40|tunepod:00000000000000ff|trial-7\n", "sacct": NO_ACCOUNTING})
    assert SlurmLauncher(launcher_spec(tmp_path), runner).find(intent(), tmp_path) is None
    assert [call[0] for call in runner.calls] == ["squeue", "sacct"]


def test_find_of_a_job_slurm_forgot_is_the_one_its_script_recorded_with_its_exit(tmp_path: Path) -> None:
    """The orchestrator died between sbatch and the record; the job ran, exited 0 and was purged
    (MinJobAge), and no accounting runs: squeue and sacct know nothing of it. Its EXIT trap (run here
    by bash, as Slurm's batch host runs it) recorded its job id with its exit: the intent resolves to
    that job, COMPLETED, and is never sent again (a finished trial would train twice)."""
    paths = JobPaths(tmp_path)
    trap = "\n".join(exit_code_trap(paths))
    environment = {"PATH": "/usr/bin:/bin", "TUNEPOD_SUBMISSION_ID": "00000000000000aa", "SLURM_JOB_ID": "77"}
    subprocess.run(["bash", "-c", f"{trap}\nexit 0"], env=environment, check=True, timeout=30)
    runner = ScriptedRunner({"squeue": "", "sacct": NO_ACCOUNTING})
    launcher = SlurmLauncher(launcher_spec(tmp_path), runner)
    assert launcher.find(intent(submission_id="00000000000000bb"), tmp_path) is None  # another attempt's
    found = launcher.find(intent(), tmp_path)
    assert found is not None and found.job_id == "77"
    record = intent().accepted(found.job_id, {})
    status = recorded_status(found.job_id, TrackedJob(tmp_path, record))
    assert status is not None and (status.job_state, status.exit_code) == (JobState.SUCCEEDED, 0)


def test_find_falls_back_to_accounting_from_a_day_before_the_intent(tmp_path: Path) -> None:
    runner = ScriptedRunner({"squeue": "", "sacct": "17|tunepod:00000000000000aa|trial-7\n"})
    found = SlurmLauncher(launcher_spec(tmp_path), runner).find(intent(), tmp_path)
    assert found is not None and found.job_id == "17"
    sacct = runner.calls[1]
    assert sacct[sacct.index("-S") + 1] == "2026-03-01T10:00:00"
    assert "--name=trial-7" in sacct


def test_find_warns_when_accounting_keeps_no_comments(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = ScriptedRunner({"squeue": "", "sacct": "17||trial-7\n"})
    assert SlurmLauncher(launcher_spec(tmp_path), runner).find(intent(), tmp_path) is None
    assert "AccountingStoreFlags=job_comment" in caplog.text


def test_find_of_a_name_with_a_comma_lists_the_users_jobs_and_matches_the_name_exactly(
    tmp_path: Path,
) -> None:
    listing = "50|tunepod:00000000000000aa|a\n51|tunepod:00000000000000aa|a, b\n"
    runner = ScriptedRunner({"squeue": listing, "sacct": NO_ACCOUNTING})
    found = SlurmLauncher(launcher_spec(tmp_path), runner).find(intent(name="a, b"), tmp_path)
    assert found is not None and found.job_id == "51"
    assert "--me" in runner.calls[0]
    assert not any(arg.startswith("--name") for arg in runner.calls[0])


def test_find_follows_the_newest_of_several_jobs_of_one_submission_and_names_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    listing = "9|tunepod:00000000000000aa|trial-7\n12|tunepod:00000000000000aa|trial-7\n"
    runner = ScriptedRunner({"squeue": listing})
    found = SlurmLauncher(launcher_spec(tmp_path), runner).find(intent(), tmp_path)
    assert found is not None and found.job_id == "12"
    assert "scancel 9" in caplog.text


def test_find_raises_when_slurm_cannot_answer(tmp_path: Path) -> None:
    down = TransientCommandFailed(["squeue"], 1, "Unable to contact slurm controller")
    runner = ScriptedRunner({"squeue": down})
    with pytest.raises(TransientError):
        SlurmLauncher(launcher_spec(tmp_path), runner).find(intent(), tmp_path)


def test_poll_answers_for_every_job_from_one_squeue_then_scontrol_for_the_gone(tmp_path: Path) -> None:
    runner = ScriptedRunner(
        {
            "squeue": f"7|RUNNING|1|vm|vm|{STARTED}|None\n",
            "scontrol": SCONTROL_FAILED,
        }
    )
    launcher = SlurmLauncher(launcher_spec(tmp_path), runner)
    running, ended = launcher.attach("7", tmp_path), launcher.attach("28", tmp_path)
    assert running.state() is JobState.RUNNING
    assert ended.status() == SlurmStatus("FAILED", "NonZeroExitCode", 3, 0)
    assert runner.calls[:2] == [
        ["squeue", "-h", "-o", "%i|%T|%D|%B|%N|%S|%r", "-j", "7,28"],
        ["scontrol", "show", "job", "-o", "28"],
    ]


NOT_ELASTIC = TrackedJob(Path("/jobs/trial-7"), intent().accepted("7", {}))


def elastic_record(asked: int) -> TrackedJob:
    """A followed job whose submission record says it is elastic and asked for ``asked`` nodes."""
    record = intent().accepted("7", {ELASTIC_NODES_DETAIL: asked})
    return TrackedJob(Path("/jobs/trial-7"), record)


def test_an_elastic_job_that_lost_its_batch_host_is_requeued_on_the_nodes_it_asked_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Slurm keeps a --no-kill job RUNNING on the survivors when the node it took out was the batch
    script's (squeue: 1 node, n2, batch host n1): no survivor can go on, so the launcher requeues it
    and asks for its 2 nodes again."""
    runner = ScriptedRunner({"squeue": f"7|RUNNING|1|n1|n2|{STARTED}|None\n"})
    statuses = SlurmLauncher(launcher_spec(tmp_path), runner).poll({"7": elastic_record(2)})
    assert statuses["7"].job_state is JobState.PENDING
    assert runner.calls[1:] == [
        ["scontrol", "requeue", "7"],
        ["scontrol", "update", "JobId=7", "NumNodes=2"],
    ]
    assert "lost its first node n1" in caplog.text


@pytest.mark.parametrize(
    ("line", "record"),
    [
        (f"7|RUNNING|1|n1|n1|{STARTED}|None\n", elastic_record(2)),  # the batch host survived: it goes on
        (f"7|RUNNING|2|n1|n[1,3]|{STARTED}|None\n", elastic_record(3)),  # in a hostlist's range
        (f"7|RUNNING|2|n1|n[1-2]|{STARTED}|None\n", elastic_record(2)),  # every node it asked for
        (f"7|RUNNING|1|n1|n2|{STARTED}|None\n", NOT_ELASTIC),
        ("7|PENDING|2|n/a||N/A|Resources\n", elastic_record(2)),
    ],
    ids=["survived-batch-host", "in-a-range", "whole", "not-elastic", "pending"],
)
def test_no_other_job_is_requeued_by_the_launcher(line: str, record: TrackedJob, tmp_path: Path) -> None:
    runner = ScriptedRunner({"squeue": line})
    SlurmLauncher(launcher_spec(tmp_path), runner).poll({"7": record})
    assert not any(call[:2] in (["scontrol", "requeue"], ["scontrol", "update"]) for call in runner.calls)


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
