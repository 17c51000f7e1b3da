"""What the API says about a job object, mapped onto tunepod's ``JobState`` (pure).

``state_from_conditions`` reads an object's ``status.conditions``; ``ObjectStatus`` is the launcher's
status type (what its status cache holds per job), including the status of an object that is gone:
FAILED, with the reason the launcher worked out (tunepod's cancel, a later submission into the job dir,
or a delete outside tunepod / an expired ``ttlSecondsAfterFinished``), unless its pods recorded that
they exited 0 (``exits.recorded_exit``): SUCCEEDED then.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tunepod.launch.base import JobState
from tunepod.launch.hyperpod_eks.api import Crd, ObjectRef

logger = logging.getLogger(__name__)

# Condition types both operators set in ``status.conditions`` (Kubeflow's JobConditionType; the HyperPod
# operator follows it and reports "Completed" as well). A terminal condition that is "True" decides;
# otherwise the job runs once a running condition is "True", and waits before that.
TERMINAL_CONDITIONS: Mapping[str, JobState] = {
    "Succeeded": JobState.SUCCEEDED,
    "Completed": JobState.SUCCEEDED,
    "Failed": JobState.FAILED,
}
RUNNING_CONDITIONS = frozenset({"Running", "PodsRunning"})
# Created: accepted, pods not all started; Suspended: held by Kueue (or by hand) until admitted.
# Restarting: the operator restarts a failed run in place, after a back-off; no process of the job
# runs until the next run starts, and that run is judged afresh (a start-up, not the last run's hang),
# as a Slurm requeue or SageMaker's Restarting is.
PENDING_CONDITIONS = frozenset({"Created", "Suspended", "Queued", "Pending", "Restarting"})


def state_from_conditions(conditions: Sequence[Mapping[str, Any]]) -> JobState:
    """The ``JobState`` of a job object from its ``status.conditions`` (empty: not seen yet, PENDING).

    An unknown condition type is logged once and ignored, so a newer operator cannot crash the
    orchestrator. Cancellation is not a condition: the launcher deletes the object and knows why.
    """
    active = [str(c.get("type", "")) for c in conditions if str(c.get("status", "")).lower() == "true"]
    for kind in active:
        if kind in TERMINAL_CONDITIONS:
            return TERMINAL_CONDITIONS[kind]
    for kind in active:
        if kind not in RUNNING_CONDITIONS | PENDING_CONDITIONS:
            _warn_unknown_condition(kind)
    return JobState.RUNNING if RUNNING_CONDITIONS.intersection(active) else JobState.PENDING


@functools.cache
def _warn_unknown_condition(kind: str) -> None:
    # Cached: a job polled every second would otherwise repeat the warning every second.
    logger.warning("unknown job condition %r ignored when mapping the job's state", kind)


@dataclass(frozen=True)
class ObjectStatus:
    """One job object as the API last showed it, or the fact that it is gone (``gone_reason``)."""

    ref: ObjectRef
    conditions: tuple[Mapping[str, Any], ...] = ()
    deleting: bool = False
    gone_reason: str | None = None
    """Why the object no longer exists; None while it does."""
    recorded_exit: int | None = None
    """For a gone object: the exit code its pods recorded in the job dir (None: none known)."""

    @classmethod
    def from_object(cls, crd: Crd, obj: Mapping[str, Any]) -> ObjectStatus:
        """The status of ``obj``, an object as the API returns it."""
        conditions = (obj.get("status") or {}).get("conditions") or []
        deleting = bool((obj.get("metadata") or {}).get("deletionTimestamp"))
        return cls(ObjectRef.of(crd, obj), tuple(conditions), deleting)

    @classmethod
    def gone(cls, ref: ObjectRef, reason: str, recorded_exit: int | None = None) -> ObjectStatus:
        return cls(ref, gone_reason=reason, recorded_exit=recorded_exit)

    @property
    def is_gone(self) -> bool:
        return self.gone_reason is not None

    @property
    def job_state(self) -> JobState:
        """From the conditions; a gone object is SUCCEEDED when its pods recorded exit 0, else FAILED
        (the job handle makes that CANCELLED when tunepod's cancel marker says tunepod deleted it)."""
        if self.is_gone:
            return JobState.SUCCEEDED if self.recorded_exit == 0 else JobState.FAILED
        return state_from_conditions(self.conditions)

    @property
    def run_mark(self) -> str | None:
        """When the current run began, as the operator stamped its running condition (``JobHandle.
        run_mark``): a run restarted in place gets a new stamp, even where no poll saw it Restarting.
        None while no running condition is true (between runs, or gone)."""
        running = [
            str(c.get("lastTransitionTime") or "")
            for c in self.conditions
            if c.get("type") in RUNNING_CONDITIONS and str(c.get("status", "")).lower() == "true"
        ]
        return max(running, default=None)

    def last_condition(self) -> str:
        """The newest condition as ``Type (Reason: message)``, or "" when there is none."""
        if not self.conditions:
            return ""
        # Stable sort: conditions without a timestamp keep their order, the API's newest last.
        newest = sorted(self.conditions, key=lambda c: str(c.get("lastTransitionTime") or ""))[-1]
        detail = ": ".join(str(newest[k]) for k in ("reason", "message") if newest.get(k))
        return f"{newest.get('type', '?')} ({detail})" if detail else str(newest.get("type", "?"))

    def describe(self, job_id: str = "") -> str:
        """One line: the object, its state and last condition, or why it is gone."""
        if self.is_gone:
            return f"{self.ref.title} is gone: {self.gone_reason}"
        line = f"{self.ref.title} {self.job_state.value}"
        if self.deleting:
            line += " (being deleted)"
        last = self.last_condition()
        return f"{line}, last condition {last}" if last else line
