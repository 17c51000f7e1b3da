"""The defects the simulation must find: each fix of issue 28 undone again, one at a time.

A mutant puts one old behaviour back (by patching the running code, never the files); the
simulation, run over seeds with the mutant in place, must break an invariant. ``python -m simulation
--mutants`` runs them all and says which seed found each one (and fails if one goes unnoticed):
proof that the invariants can fail, and a measure of how many seeds a kind of defect needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from simulation.backends import KINDS
from tunepod.hpo import population, study, tuner
from tunepod.hpo.asha import ATTR_ASHA, Asha, AshaState, is_paused
from tunepod.launch import base, drive, lease
from tunepod.launch.drive import DriveSettings
from tunepod.launch.hyperpod_eks import launcher as eks_launcher
from tunepod.launch.local import LocalLauncher, LocalStatus
from tunepod.launch.paths import JobPaths
from tunepod.launch.sagemaker import states as sagemaker_states
from tunepod.launch.slurm import launcher as slurm_launcher
from tunepod.launch.slurm import render
from tunepod.launch.slurm import states as slurm_states
from tunepod.launch.watchdog import Watchdog
from tunepod.locks import locked
from tunepod.runtime.checkpoints import CheckpointInfo
from tunepod.runtime.progress import RankProgress, read_progress
from tunepod.spec.models import PrunerSpec


@dataclass(frozen=True)
class Mutant:
    name: str
    defect: str
    apply: Callable[[], contextlib.AbstractContextManager[None]]
    kinds: tuple[str, ...] = KINDS
    """The backends whose seeds can show it (a defect of one launcher: its seeds only)."""


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, original)


def _leases_leak() -> contextlib.AbstractContextManager[None]:
    return _patched(tuner.Tuner, "_let_go_of_unstarted", lambda self: None)


def _half_asked_trained() -> contextlib.AbstractContextManager[None]:
    def never(trial: FrozenTrial) -> bool:
        return False

    return _patched(tuner, "_half_asked", never)


def _unfenced() -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def fenced_without_a_check(self: lease.Lease) -> Iterator[None]:
        with locked(JobPaths(self.job_dir).lease_lock):
            yield

    return _patched(lease.Lease, "fenced", fenced_without_a_check)


def _host_clock_trusted() -> contextlib.AbstractContextManager[None]:
    """The watchdog before: idleness and run time on the driver's wall clock alone."""

    def stall(self: Watchdog, job_id: str, now: float) -> Any:
        limit = self.limits.hang_timeout_s
        beats = [beat for beat in read_progress(self.paths.progress) if not beat.finished]
        stalled = [beat for beat in beats if limit is not None and now - beat.advanced_at > limit]
        return _OldStall(stalled) if stalled else None

    def timed_out(self: Watchdog, job_id: str, now: float) -> bool:
        limit = self.limits.timeout_s
        return limit is not None and now - self.running_since(job_id) > limit

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(Watchdog, "stall", stall))
    stack.enter_context(_patched(Watchdog, "timed_out", timed_out))
    return stack  # type: ignore[return-value]


@dataclass(frozen=True)
class _OldStall:
    beats: list[Any]

    def describe(self) -> str:
        return f"{len(self.beats)} rank(s) stalled (by the driver's wall clock)"


def _purged_is_failed() -> contextlib.AbstractContextManager[None]:
    return _patched(render, "exit_code_trap", lambda paths: [])


def _leftovers_ignored() -> contextlib.AbstractContextManager[None]:
    """The local launcher before: a wrapper's recorded exit code ends the job, whatever still runs."""

    def ended(self: LocalLauncher, job_id: str, record: object, code: int, found: object) -> LocalStatus:
        return LocalStatus(running=False, exit_code=code)

    return _patched(LocalLauncher, "_sweep_leftovers", ended)


def _forgotten_intent_sent_again() -> contextlib.AbstractContextManager[None]:
    """The Slurm launcher before: an intent whose job ran and was purged, with no accounting, is sent
    again, whatever its script recorded."""
    return _patched(slurm_launcher, "_ended_and_forgotten", lambda intent, job_dir: None)


def _requeued_is_failed() -> contextlib.AbstractContextManager[None]:
    """Slurm's states with a requeued job read as failed, as if its node's failure had ended it."""
    table = {**slurm_states.SLURM_STATES, "REQUEUED": base.JobState.FAILED}
    return _patched(slurm_states, "SLURM_STATES", table)


def _node_fail_is_cancelled() -> contextlib.AbstractContextManager[None]:
    """Slurm's states with NODE_FAIL read as a cancel (the controller killed the job), which no
    restart follows."""
    table = {**slurm_states.SLURM_STATES, "NODE_FAIL": base.JobState.CANCELLED}
    return _patched(slurm_states, "SLURM_STATES", table)


def _left_behind_beats_count() -> contextlib.AbstractContextManager[None]:
    """The watchdog before: every heartbeat in the job dir is the current run's, the beats of a rank
    that a lost node left behind (live after the requeue or the restart) included."""

    def every_beat(self: Watchdog) -> list[RankProgress]:
        return read_progress(self.paths.progress)

    return _patched(Watchdog, "_beats", every_beat)


def _decided_stop_wins() -> contextlib.AbstractContextManager[None]:
    return _patched(drive.JobDriver, "_ended_on_its_own", lambda self, state: False)


def _stopped_upload_cancelled() -> contextlib.AbstractContextManager[None]:
    """SageMaker's states before: a job stopped while its output uploaded (its script had exited 0,
    ``Uploading`` before ``Stopping`` in its transitions) is CANCELLED, as if the stop ended its training."""
    return _patched(sagemaker_states, "trained_before_stop", lambda transitions: False)


def _wall_clock_timeout() -> contextlib.AbstractContextManager[None]:
    """The watchdog before: a job without heartbeats times out on the driver's wall clock alone."""

    def timed_out(self: Watchdog, job_id: str, now: float) -> bool:
        limit = self.limits.timeout_s
        if limit is None or not self._wall_clock_past(job_id, now, limit):
            return False
        ranks = self._ranks()
        return not ranks or max(ran + rank.beat.interval_s for rank, ran in ranks) > limit

    return _patched(Watchdog, "timed_out", timed_out)


def _ttl_deleted_is_failed() -> contextlib.AbstractContextManager[None]:
    """The HyperPod EKS launcher before: a gone object is FAILED whatever its pods recorded."""
    return _patched(eks_launcher, "_recorded_exit", lambda job: None)


def _sent_intent_refused() -> contextlib.AbstractContextManager[None]:
    """The template before: a submit retried after a lost create reply and a failed look-up finds its
    intent's job and refuses it while it runs (the trial abandoned), or starts a new attempt beside it
    once it ended (the attempt run twice)."""
    return _patched(base, "_intent_was_sent", lambda previous: False)


def _gone_intent_sent_again() -> contextlib.AbstractContextManager[None]:
    """The HyperPod EKS launcher before: an intent whose object is gone (its TTL deleted it before its
    creation reached the record) is sent again, whatever its pods recorded."""
    return _patched(eks_launcher, "_ended_unrecorded", lambda intent, job_dir: False)


def _pause_recorded_at_the_decision() -> contextlib.AbstractContextManager[None]:
    """ASHA recording a pause as it decides it (from the report feed, outside the fence), before the
    job has stopped: a paused trial with a live job, which a restarted orchestrator would promote."""
    decide = tuner.ReportFeed._asha_says

    def record_at_once(self: tuner.ReportFeed, asha: Any) -> Any:
        reason = decide(self, asha)
        if reason == "paused" and self.paused_rung is not None:
            state = AshaState(self.paused_rung, True, attempt=1)
            self._tuner.trials.set_attr(self._number, ATTR_ASHA, state.to_attr())
        return reason

    return _patched(tuner.ReportFeed, "_asha_says", record_at_once)


def _continued_without_looking() -> contextlib.AbstractContextManager[None]:
    """PBT creating an exploited trial's continuation without first looking for one: a rerun after a
    crash between the creation and the exploited trial's PRUNED creates a second, and the member
    trains twice."""
    return _patched(population.Population, "continuation_of", lambda self, number: None)


def _promotions_eat_restarts() -> contextlib.AbstractContextManager[None]:
    """A promoted trial's drive with only ``max_restarts``: its promotions, attempts that are no
    restarts, spend the restarts a failure would have had."""

    def drive_settings(self: tuner.Tuner, asha_state: AshaState | None) -> DriveSettings:
        promotions = asha_state.promotions if asha_state else 0
        return DriveSettings(
            poll_s=self.settings.poll_s,
            max_restarts=self.settings.train.max_restarts,
            resume_attempt=asha_state.attempt if asha_state and promotions else None,
        )

    return _patched(tuner.Tuner, "_drive_settings", drive_settings)


def _asha_keeps_one_too_many() -> contextlib.AbstractContextManager[None]:
    """ASHA's rung keeping one trial more than its top ``1 / reduction_factor``."""

    def kept(self: Asha, reached: int) -> int:
        return max(1, reached // self.reduction_factor) + 1 if reached else 0

    return _patched(Asha, "kept", kept)


def _asha_prunes_while_busy() -> contextlib.AbstractContextManager[None]:
    """ASHA's end of the study pruning the paused trials once a trial has completed, while the study's
    own trials still run (and could still put a paused one in the top)."""

    def end_of_study(self: tuner.Tuner, trials: list[FrozenTrial], capacity: int, *, busy: bool) -> list[int]:
        assert self.asha is not None
        if not any(t.state is TrialState.COMPLETE for t in trials):
            paused = self.asha.by_merit(trials)
            return [] if capacity <= 0 else self._promote(trials, paused, capacity, idle=True)
        for trial in trials:
            if is_paused(trial):
                self._prune_paused(trial)
        return []

    return _patched(tuner.Tuner, "_end_of_study", end_of_study)


def _pbt_copies_its_own() -> contextlib.AbstractContextManager[None]:
    """PBT copying the exploited member's own newest checkpoint while it records the donor's."""

    def copy_from_a_donor(
        self: population.Population, exploited: FrozenTrial, donors: Any, trials: Any
    ) -> tuple[FrozenTrial, CheckpointInfo | None]:
        for member in donors:
            head = self.pbt.head(member, trials)
            copied = self._copy_newest(exploited, self.job_dir(exploited) / f"pbt-seed-from-{head.number}")
            if copied is not None:
                return head, copied
        own = self._copy_newest(exploited, self.job_dir(exploited) / f"pbt-seed-from-{exploited.number}")
        return exploited, own

    return _patched(population.Population, "_copy_from_a_donor", copy_from_a_donor)


def _threshold_bounds_swapped() -> contextlib.AbstractContextManager[None]:
    """The threshold pruner built with its bounds swapped: it prunes the trials that rise above
    ``lower`` instead of those that fall below it."""
    make = study.make_pruner

    def make_pruner(spec: PrunerSpec) -> optuna.pruners.BasePruner:
        if spec.kind != "threshold":
            return make(spec)
        lower, upper = spec.upper, spec.lower
        return optuna.pruners.ThresholdPruner(lower=lower, upper=upper, n_warmup_steps=spec.warmup_steps)

    return _patched(study, "make_pruner", make_pruner)


MUTANTS = [
    Mutant("leases-leak", "issue 28, 2: leases of trials a failed ask never started stay held", _leases_leak),
    Mutant(
        "half-asked",
        "issue 28, 5: a trial a failed ask left behind is trained on defaults",
        _half_asked_trained,
    ),
    Mutant(
        "unfenced", "issue 28, 9: a driver whose lease was taken acts until its heartbeat notices", _unfenced
    ),
    Mutant(
        "host-clock",
        "issue 28, 8 and clock jumps: the watchdog trusts the driver's wall clock",
        _host_clock_trusted,
    ),
    Mutant(
        "purged-failed",
        "a job Slurm purged after it exited 0 is read as FAILED",
        _purged_is_failed,
        kinds=("slurm",),
    ),
    Mutant(
        "forgotten-intent",
        "a Slurm job that ran and was purged before its job id reached the record is submitted again",
        _forgotten_intent_sent_again,
        kinds=("slurm",),
    ),
    Mutant(
        "requeued-failed",
        "a Slurm job requeued after a node failure is read as FAILED",
        _requeued_is_failed,
        kinds=("slurm",),
    ),
    Mutant(
        "node-fail-cancelled",
        "a Slurm job that ended NODE_FAIL is read as cancelled, and not restarted",
        _node_fail_is_cancelled,
        kinds=("slurm",),
    ),
    Mutant(
        "left-behind-beats",
        "a rank that a Slurm node left behind, beating on after its job was requeued or restarted, "
        "is taken for the next run's and stops it as hung or timed out",
        _left_behind_beats_count,
        kinds=("slurm",),
    ),
    Mutant(
        "late-stop",
        "a job that finished before a decided stop reached it is counted as stopped",
        _decided_stop_wins,
    ),
    Mutant(
        "leftovers-ignored",
        "issue 28, 3: a local job whose wrapper exited counts as ended while its workers train on",
        _leftovers_ignored,
        kinds=("local",),
    ),
    Mutant(
        "ttl-failed",
        "a HyperPod EKS job whose TTL deleted its object after it exited 0 is read as FAILED",
        _ttl_deleted_is_failed,
        kinds=("hyperpod_eks",),
    ),
    Mutant(
        "gone-intent",
        "a HyperPod EKS job that ran and was TTL-deleted before its creation was recorded is created again",
        _gone_intent_sent_again,
        kinds=("hyperpod_eks",),
    ),
    Mutant(
        "stopped-upload",
        "SageMaker: a job a stop reached while it uploaded, after its script exited 0, counts as stopped",
        _stopped_upload_cancelled,
        kinds=("sagemaker",),
    ),
    Mutant(
        "wall-clock-timeout",
        "a job without heartbeats (SageMaker without writable FSx) times out on its driver's wall clock",
        _wall_clock_timeout,
    ),
    Mutant(
        "early-pause",
        "issue 30: an ASHA pause recorded when decided, while the trial's job still runs",
        _pause_recorded_at_the_decision,
    ),
    Mutant(
        "sent-intent-refused",
        "a submit retried after a lost create reply refuses its own attempt's job, or runs it again",
        _sent_intent_refused,
        kinds=("sagemaker",),
    ),
    Mutant(
        "continued-twice",
        "PBT: an exploited trial's continuation created without looking for one made before a crash",
        _continued_without_looking,
        # Every backend's seeds, though SageMaker's never run PBT: fewer kinds draw other scenarios.
        # Found by 10 of the first 1000 since the crashes just after a write (1 before).
    ),
    Mutant(
        "promotions-eat-restarts",
        "ASHA's promotions counted against max_restarts: a promoted trial fails with restarts unspent",
        _promotions_eat_restarts,
        # Found by 3 of the first 300 seeds (the first, 41) since ASHA's seeds crash more (1 before).
    ),
    Mutant(
        "asha-keeps-one-too-many",
        "ASHA's rungs keep one trial more than their top: trials go on, or are promoted, outside it",
        _asha_keeps_one_too_many,
    ),
    Mutant(
        "asha-prunes-while-busy",
        "ASHA's end of the study prunes the paused trials while the study's own trials still run",
        _asha_prunes_while_busy,
    ),
    Mutant(
        "pbt-wrong-donor",
        "PBT seeds a continuation with the exploited member's own checkpoint, recording the donor's",
        _pbt_copies_its_own,
    ),
    Mutant(
        "threshold-swapped",
        "the threshold pruner built with lower and upper swapped: trials above the bound are pruned",
        _threshold_bounds_swapped,
    ),
]


def mutant(name: str) -> Mutant:
    found = [m for m in MUTANTS if m.name == name]
    if not found:
        raise SystemExit(f"no mutant {name!r}; the mutants: {', '.join(m.name for m in MUTANTS)}")
    return found[0]
