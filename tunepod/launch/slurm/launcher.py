"""Run jobs as sbatch jobs on a Slurm cluster (SageMaker HyperPod's Slurm orchestrator included).

``SlurmLauncher`` fills in the hooks of ``LauncherBase``, which keeps every piece of bookkeeping (the
write-ahead submission record, refuse-if-running, the cancel marker, warn-once, the status cache):

- ``render``: the batch script (``render.py``, pure), kept in the job dir as ``job.sbatch``;
- ``send``: ``sbatch --parsable`` through a ``CommandRunner``, here or on the head node over ssh;
- ``find``: the job of a submission whose reply never arrived, by its job name AND its comment
  ``tunepod:<submission id>`` (every attempt in a job dir has the same name);
- ``poll``: ONE ``squeue`` call for every open job, then ``scontrol`` (or ``sacct``) once for each job
  that left the queue, for its final state and exit code, and for a job Slurm has forgotten, the
  exit code its script recorded in the job dir (``tunepod.launch.exit_code``); K trials polling
  every half second cost one squeue call per ``spec.poll_cache_s``, not K.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from hostlist import expand_hostlist

from tunepod import world
from tunepod.errors import JobError
from tunepod.launch.base import Accepted, Job, JobSpec, JobState, LauncherBase, Rendered
from tunepod.launch.exit_code import read_exit_code, recorded_job_id, temp_exit_file
from tunepod.launch.paths import JobPaths, file_logs
from tunepod.launch.runner import CommandRunner, LocalRunner, SshRunner
from tunepod.launch.slots import Slots
from tunepod.launch.slurm.commands import SlurmCommands
from tunepod.launch.slurm.nodes import idle_node_slots
from tunepod.launch.slurm.render import (
    SCRIPT_NAME,
    detect_hyperpod,
    ignored_resources,
    render_sbatch,
    submission_comment,
)
from tunepod.launch.slurm.states import ListedJob, SlurmStatus, purged_status
from tunepod.launch.status_cache import TrackedJob
from tunepod.launch.submission import Submission
from tunepod.spec.models import SlurmLauncherSpec
from tunepod.spec.resources import Resources

logger = logging.getLogger(__name__)
ELASTIC_NODES_DETAIL = "elastic_nodes"
"""The submission record's fact: how many nodes an elastic job asked for (``_requeued_if_headless``)."""

_CANCEL_POLL_S = 0.2


class SlurmLauncher(LauncherBase[SlurmStatus]):
    """Submits jobs with sbatch (here, or on ``spec.ssh`` over ssh) and follows them with one cache.

    ``spec.root`` must be the same path here and on the compute nodes: the orchestrator reads the
    logs, metrics and results the jobs write there. Thread safety: as ``LauncherBase``; the hooks keep
    no state of their own.

    Without accounting (no slurmdbd), Slurm forgets an ended job MinJobAge after it ended: an intent
    whose job ended longer ago than that (an orchestrator down for hours right after sbatch) is then
    read as never sent, and the attempt runs again.
    """

    kind = "slurm"
    stop_hint = "cancel it (scancel {job_id})"

    def __init__(
        self,
        spec: SlurmLauncherSpec,
        runner: CommandRunner | None = None,
        *,
        cancel_timeout_s: float = 120.0,
        stale_limit_s: float = 300.0,
    ) -> None:
        super().__init__(
            poll_cache_s=spec.poll_cache_s,
            cancel_timeout_s=cancel_timeout_s,
            cancel_poll_s=_CANCEL_POLL_S,
            stale_limit_s=stale_limit_s,
        )
        self.spec = spec
        self.runner = runner or (SshRunner(spec.ssh, spec.ssh_options) if spec.ssh else LocalRunner())
        self.hyperpod = detect_hyperpod(spec)
        self.slurm = SlurmCommands(self.runner)

    # ------------------------------------------------------------------------------------ hooks

    def render(self, job: JobSpec, attempt: int, variant: int = 0) -> Rendered:
        # Slurm never reserves a name, so there is no variant to render: the comment tells jobs apart.
        script = render_sbatch(job, self.spec, hyperpod=self.hyperpod)
        # An elastic job may shrink; what it asked for is how many nodes a requeue asks for again.
        details = {ELASTIC_NODES_DETAIL: job.resources.num_nodes} if job.resources.elastic else {}
        return Rendered(name=job.name, payload=script, files={SCRIPT_NAME: script}, details=details)

    def send(self, job: JobSpec, rendered: Rendered, intent: Submission) -> Accepted:
        # Over ssh the head node may not see the script we just wrote yet (attribute caching on the
        # shared filesystem); stdin does not depend on it.
        script_path = None if self.spec.ssh else job.job_dir / SCRIPT_NAME
        return Accepted(self.slurm.sbatch(rendered.payload, script_path))

    def find(self, intent: Submission, job_dir: Path) -> Accepted | None:
        """The job named ``intent.name`` whose comment names ``intent.submission_id``: first among the
        jobs the controller knows (queued, running, recently ended), then in the accounting database,
        then, for a job that ended and was forgotten by both, the one its script recorded with its exit
        in the job dir (never created again: it ran)."""
        comment = submission_comment(intent.submission_id)
        mine = [job for job in self.slurm.named(intent.name) if job.comment == comment]
        if not mine:
            since = datetime.fromisoformat(intent.intent_at)
            accounted = self.slurm.accounted_named(intent.name, since)
            mine = [job for job in accounted if job.comment == comment]
            _warn_if_comments_missing(intent, accounted, mine)
        if not mine:
            return _ended_and_forgotten(intent, job_dir)
        newest, *others = sorted(mine, key=lambda job: int(job.job_id), reverse=True)
        if others:
            extra = " ".join(job.job_id for job in others)
            logger.warning(
                "%s: Slurm holds several jobs of submission %s (%s); following %s, the newest. If the "
                "others still run, cancel them: scancel %s",
                job_dir,
                intent.submission_id,
                intent.name,
                newest.job_id,
                extra,
            )
        return Accepted(newest.job_id)

    def poll(self, jobs: Mapping[str, TrackedJob]) -> dict[str, SlurmStatus]:
        open_ids = sorted(jobs, key=int)
        queued = self.slurm.queued(open_ids)
        for job_id, status in queued.items():
            if job_id in jobs:
                queued[job_id] = self._requeued_if_headless(job_id, status, jobs[job_id])
        return {job_id: self._current_status(job_id, queued.get(job_id), jobs[job_id]) for job_id in open_ids}

    def stop(self, job: Job[SlurmStatus]) -> None:
        """A running job whose ``resources.stop_grace_s`` is set gets SIGTERM in its tasks only
        (``scancel --signal=TERM``) and that long to save and exit on its own; what still runs then is
        cancelled. A plain ``scancel`` would also signal the batch script, and the tasks would get only
        the cluster's KillWait: a script still importing torch for its first save was killed mid-save
        under load. The grace is read from the submission record, which carries it from the intent
        on (also for a job adopted after a lost sbatch reply or a crash). Without the setting (or
        without a record: a job attached by id alone): ``scancel``, and KillWait is the grace."""
        grace_s = job.record.stop_grace_s if job.record is not None else None
        if grace_s is not None and job.status(max_age_s=0).job_state is JobState.RUNNING:
            self.slurm.scancel(job.job_id, signal="TERM")
            if self._ended_within(job, grace_s):
                return
            logger.warning("slurm job %s still runs %ss after SIGTERM; cancelling it", job.job_id, grace_s)
        self.slurm.scancel(job.job_id)

    def _ended_within(self, job: Job[SlurmStatus], timeout_s: float) -> bool:
        deadline = world.monotonic() + timeout_s
        while not job.status(max_age_s=self.cancel_poll_s).job_state.is_terminal:
            if world.monotonic() > deadline:
                return False
            world.sleep(self.cancel_poll_s)
        return True

    def read_logs(self, job: Job[SlurmStatus], tail: int) -> str:
        return file_logs(job.paths, tail)

    def run_mark(self, status: SlurmStatus) -> str | None:
        """The running job's start time: a requeue that no look saw (the job queued and ran again
        between two looks, or while squeue failed) shows as a new start."""
        return (status.start_time or None) if status.job_state is JobState.RUNNING else None

    def describe_status(self, job: Job[SlurmStatus], status: SlurmStatus) -> str:
        # Slurm's state, reason and exit code explain a TIMEOUT or OUT_OF_MEMORY that the log cannot.
        return status.describe(job.job_id)

    def ignored_settings(self, job: JobSpec) -> dict[str, str]:
        return ignored_resources(job.resources)

    def stale_outcome_files(self, paths: JobPaths) -> list[Path]:
        return [paths.exit_code, Path(temp_exit_file(paths))]

    def check_job_id(self, job_id: str) -> None:
        if not job_id.isdigit():
            raise JobError(f"{job_id!r} is not a slurm job id (expected digits, as sbatch --parsable prints)")

    def trial_slots(self, resources: Resources) -> Slots:
        """``num_parallel: auto``: the idle nodes of the partition jobs go to, per trial's nodes
        (``tunepod.launch.slurm.nodes``), asked with sinfo where sbatch runs (over ssh too)."""
        return idle_node_slots(self.slurm.nodes(), self.spec.partition, resources.num_nodes)

    # ------------------------------------------------------------------------------------ internals

    def _requeued_if_headless(self, job_id: str, status: SlurmStatus, job: TrackedJob) -> SlurmStatus:
        """An elastic job that lost its first node, requeued; any other status as it is.

        Under ``--no-kill`` Slurm takes a failed node out of the job and keeps it RUNNING on the
        others, also when the node was the batch script's (Slurm 22.05 logs "batch step received ...
        This should never happen" and leaves it so): the script is gone with the node, and so is
        torchrun's rendezvous, which it hosted, so no survivor can go on, yet the job holds their
        nodes until its time limit. Such a job is requeued here, asking for the nodes it asked for at
        first (Slurm would start it on the ones it shrank to), as Slurm requeues a job without
        ``--no-kill`` that loses a node; it restores from its checkpoints (a survivor's memory)."""
        asked = job.record.details.get(ELASTIC_NODES_DETAIL) if job.record is not None else None
        if (
            status.job_state is not JobState.RUNNING
            or asked is None
            or status.node_count is None
            or status.node_count >= int(asked)
            or not status.batch_host
            or status.batch_host in expand_hostlist(status.nodelist)
        ):
            return status
        logger.warning(
            "slurm job %s lost its first node %s (its batch script and rendezvous); the other nodes "
            "cannot go on without it, so it is requeued on %s nodes and resumes from its checkpoints",
            job_id,
            status.batch_host,
            asked,
        )
        self.slurm.requeue(job_id, int(asked))
        return SlurmStatus("REQUEUED", reason=f"its first node {status.batch_host} was lost")

    def _current_status(self, job_id: str, queued: SlurmStatus | None, job: TrackedJob) -> SlurmStatus:
        if queued is not None and not queued.job_state.is_terminal:
            return queued
        # Gone from the queue (or ended): scontrol has the exit code while Slurm remembers the job
        # (MinJobAge); sacct, where accounting runs, after that; else what the script recorded.
        return (
            self.slurm.remembered(job_id)
            or queued
            or self.slurm.accounted(job_id)
            or recorded_status(job_id, job)
            or purged_status(job_id)
        )


def recorded_status(job_id: str, job: TrackedJob) -> SlurmStatus | None:
    """The status of a job Slurm has forgotten, from the exit code its script recorded in the job dir
    (None when it recorded none: killed, or never ran)."""
    record = job.record
    code = read_exit_code(JobPaths(job.job_dir), record.submission_id) if record is not None else None
    if code is None:
        return None
    state = "COMPLETED" if code == 0 else "FAILED"
    return SlurmStatus(state, reason=f"purged by Slurm; exit code recorded in {job.job_dir}", exit_code=code)


def _ended_and_forgotten(intent: Submission, job_dir: Path) -> Accepted | None:
    """The job of ``intent`` that ran, recorded its exit and job id, and was purged (``MinJobAge``) with
    no accounting to remember it; None when its script recorded none (it never ran, or a script from
    before job ids were recorded)."""
    job_id = recorded_job_id(JobPaths(job_dir), intent.submission_id)
    if job_id is None or not job_id.isdigit():
        return None
    logger.info(
        "%s: job %s of submission %s ended and Slurm has forgotten it; its exit is recorded in the job dir",
        job_dir,
        job_id,
        intent.submission_id,
    )
    return Accepted(job_id)


def _warn_if_comments_missing(intent: Submission, accounted: list[ListedJob], mine: list[ListedJob]) -> None:
    """Say why an intent may be sent again when accounting lists its name without any comments."""
    if mine or not accounted or any(job.comment for job in accounted):
        return
    logger.warning(
        "sacct lists jobs named %r but stores no comments, so tunepod cannot tell whether one of them is "
        "submission %s; set AccountingStoreFlags=job_comment in slurm.conf. Check `sacct --name=%s` "
        "and cancel a duplicate if one appears",
        intent.name,
        intent.submission_id,
        intent.name,
    )
