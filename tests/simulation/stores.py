"""The simulated Optuna storage and MLflow tracking store: the real data model, calls that fail.

**Optuna.** The study lives in one ``optuna.storages.InMemoryStorage``, the database, which
outlives every orchestrator; each orchestrator process reaches it through its own ``SimStorage``,
where every call is a yield point, takes its round trip's time (the seed's ``Latency.optuna``) and may
fail as a database does: before it commits (nothing happened) or after (it happened, and the caller
hears an error), with the error tunepod reads as transient ("database is locked").

**MLflow.** ``MlflowTwin`` keeps runs, tags, params, metric histories (a point logged again with the
same key, value, step and timestamp is stored once, as MLflow's SQL stores do), run statuses and
logged models; each orchestrator process reaches it through its own ``SimTracker``, with the
methods of ``tunepod.tracking.RunTracker`` (what the tuning loop calls of MLflow), each taking its
round trip's time (``Latency.mlflow``), and the same two ways to fail.

A call takes effect once its time has passed: meanwhile its thread waits with whatever locks it holds
(a lease's fence, the outbox's mirror), and other threads, and faults, go on.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from optuna.storages import BaseStorage, InMemoryStorage
from optuna.trial import TrialState

from simulation.scheduler import TRIALS_CHANGED, Scheduler, Span
from tunepod.hpo.asha import ATTR_ASHA, AshaState
from tunepod.tracking.mlflow_tracker import MetricPoint, RunStatus

T = TypeVar("T")


@dataclass(frozen=True)
class Faults:
    """How often a call fails: before it takes effect, and after."""

    before: float = 0.0
    after: float = 0.0


@dataclass
class FaultSwitch:
    """Faults strike only while this is on (the scenario's fault phase)."""

    on: bool = True


class OperationalError(Exception):
    """What SQLAlchemy raises on a locked database: ``tunepod.errors.is_transient`` retries it."""

    def __init__(self, what: str) -> None:
        super().__init__(f"(simulated) database is locked during {what}")


class MlflowUnavailable(ConnectionError):
    """A tracking server that did not answer (or whose answer was lost)."""


def _faulty(
    sim: Scheduler,
    faults: Faults,
    switch: FaultSwitch,
    what: str,
    call: Callable[[], T],
    error: Callable[[], Exception],
    latency: Span,
) -> T:
    sim.takes(what, latency)
    if not switch.on:
        return call()
    if sim.choices.chance(faults.before):
        sim.trace.event(sim.now, "fault", f"{sim.process.name}: {what} fails before it takes effect")
        raise error()
    result = call()
    if sim.choices.chance(faults.after):
        sim.trace.event(sim.now, "fault", f"{sim.process.name}: {what} took effect; its answer is lost")
        raise error()
    return result


# ---------------------------------------------------------------------------------- Optuna


class OptunaDatabase:
    """The study's database, and who moved each trial to a finished state (for the invariants)."""

    def __init__(self) -> None:
        self.storage = InMemoryStorage()
        self.finished_by: dict[int, list[str]] = {}
        """trial id -> the processes whose tell took effect (more than one is a bug)."""
        self.on_told: Callable[[int, TrialState], None] | None = None
        """Called as a tell takes effect, in the telling thread (the referee checks its fence)."""
        self.on_asha: Callable[[int, AshaState], None] | None = None
        """Called as a trial's ASHA pause state is written (a pause or a promotion), in the writing
        thread (the referee checks its fence and that a paused trial has no live job)."""


class SimStorage(BaseStorage):
    """One orchestrator's connection to the study's database (see the module docstring)."""

    def __init__(
        self,
        sim: Scheduler,
        database: OptunaDatabase,
        *,
        write_faults: Faults,
        read_faults: Faults,
        switch: FaultSwitch,
        crash_after_write: float = 0.0,
        lost_pause_answers: float = 0.0,
    ) -> None:
        self.sim = sim
        self.database = database
        self.write_faults = write_faults
        self.read_faults = read_faults
        self.switch = switch
        self.crash_after_write = crash_after_write
        self.lost_pause_answers = lost_pause_answers

    def _call(self, name: str, faults: Faults, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.database.storage, name)

        def call() -> Any:
            result = method(*args, **kwargs)
            if name == "set_trial_state_values" and result:
                self._told(args[0], kwargs.get("state", args[1] if len(args) > 1 else None))
            if name == "set_trial_user_attr" and args[1] == ATTR_ASHA and self.database.on_asha is not None:
                self.database.on_asha(args[0], AshaState(**json.loads(args[2])))
            return result

        return _faulty(
            self.sim,
            faults,
            self.switch,
            f"optuna {name}",
            call,
            lambda: OperationalError(name),
            self.sim.latency.optuna,
        )

    def _write(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """A write that may fail (``write_faults``), and after which the orchestrator may be killed
        (``crash_after_write``): whatever its next write would have made whole stays half done. The
        answer of a write of a trial's ASHA state (a pause, a promotion) is lost more often
        (``lost_pause_answers``): its writer retries while the other threads see the state it wrote."""
        result = self._call(name, self.write_faults, *args, **kwargs)
        self.sim.changed(TRIALS_CHANGED)
        if self.switch.on and self.sim.choices.chance(self.crash_after_write):
            # Dead before its caller hears the answer: its thread never runs again past this pause.
            self.sim.crash(self.sim.process, f"SIGKILL just after optuna {name} committed")
            self.sim.pause(f"killed after optuna {name}")
        pausing = name == "set_trial_user_attr" and args[1] == ATTR_ASHA
        if pausing and self.switch.on and self.sim.choices.chance(self.lost_pause_answers):
            # Its writer retries (after a backoff) while every other thread already sees the new state.
            self.sim.trace.event(
                self.sim.now, "fault", f"{self.sim.process.name}: an ASHA state's answer is lost"
            )
            raise OperationalError(name)
        return result

    def _told(self, trial_id: int, state: TrialState | None) -> None:
        if state is None or not state.is_finished():
            return
        who = self.sim.process.name
        if self.database.on_told is not None:
            self.database.on_told(trial_id, state)
        self.database.finished_by.setdefault(trial_id, []).append(who)
        self.sim.trace.event(self.sim.now, "optuna", f"{who} tells trial id {trial_id} {state.name}")

    def create_new_study(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("create_new_study", *args, **kwargs)

    def delete_study(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("delete_study", *args, **kwargs)

    def set_study_user_attr(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("set_study_user_attr", *args, **kwargs)

    def set_study_system_attr(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("set_study_system_attr", *args, **kwargs)

    def create_new_trial(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("create_new_trial", *args, **kwargs)

    def set_trial_param(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("set_trial_param", *args, **kwargs)

    def set_trial_state_values(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("set_trial_state_values", *args, **kwargs)

    def set_trial_intermediate_value(self, *args: Any, **kwargs: Any) -> Any:
        # A report's value alone opens no window (the report is in the job's metrics file too).
        return self._call("set_trial_intermediate_value", self.write_faults, *args, **kwargs)

    def set_trial_user_attr(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("set_trial_user_attr", *args, **kwargs)

    def set_trial_system_attr(self, *args: Any, **kwargs: Any) -> Any:
        return self._write("set_trial_system_attr", *args, **kwargs)

    def get_study_id_from_name(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_study_id_from_name", self.read_faults, *args, **kwargs)

    def get_study_name_from_id(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_study_name_from_id", self.read_faults, *args, **kwargs)

    def get_study_directions(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_study_directions", self.read_faults, *args, **kwargs)

    def get_study_user_attrs(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_study_user_attrs", self.read_faults, *args, **kwargs)

    def get_study_system_attrs(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_study_system_attrs", self.read_faults, *args, **kwargs)

    def get_all_studies(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_all_studies", self.read_faults, *args, **kwargs)

    def get_trial_id_from_study_id_trial_number(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_trial_id_from_study_id_trial_number", self.read_faults, *args, **kwargs)

    def get_trial_number_from_id(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_trial_number_from_id", self.read_faults, *args, **kwargs)

    def get_trial(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_trial", self.read_faults, *args, **kwargs)

    def get_all_trials(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_all_trials", self.read_faults, *args, **kwargs)

    def get_n_trials(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_n_trials", self.read_faults, *args, **kwargs)

    def get_trial_params(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_trial_params", self.read_faults, *args, **kwargs)

    def get_trial_user_attrs(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_trial_user_attrs", self.read_faults, *args, **kwargs)

    def get_trial_system_attrs(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get_trial_system_attrs", self.read_faults, *args, **kwargs)

    def check_trial_is_updatable(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("check_trial_is_updatable", self.read_faults, *args, **kwargs)


# ---------------------------------------------------------------------------------- MLflow


@dataclass
class RunRecord:
    run_id: str
    name: str
    parent_run_id: str | None
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    """key -> points (value, step, timestamp ms), each once."""
    status: str = "RUNNING"
    models: list[tuple[str, str, str]] = field(default_factory=list)
    """(model id, name, status)."""
    texts: dict[str, str] = field(default_factory=dict)

    def log_point(self, key: str, value: float, step: int, timestamp_ms: int) -> None:
        points = self.metrics.setdefault(key, [])
        if (value, step, timestamp_ms) not in points:
            points.append((value, step, timestamp_ms))


class MlflowTwin:
    """The tracking store: every run of the experiment."""

    def __init__(self) -> None:
        self.runs: dict[str, RunRecord] = {}
        self._ids = itertools.count(1)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):04d}"

    def runs_with_key(self, key: str) -> list[RunRecord]:
        return [run for run in self.runs.values() if run.tags.get("tunepod.key") == key]


class SimTracker:
    """One orchestrator's client of the tracking store, a ``RunTracker`` as ``MlflowTracker`` is."""

    tracking_uri = "sim://mlflow"
    experiment_id = "1"

    def __init__(self, sim: Scheduler, twin: MlflowTwin, faults: Faults, switch: FaultSwitch) -> None:
        self.sim = sim
        self.twin = twin
        self.faults = faults
        self.switch = switch

    def _call(self, what: str, action: Callable[[], T]) -> T:
        return _faulty(
            self.sim,
            self.faults,
            self.switch,
            f"mlflow {what}",
            action,
            lambda: MlflowUnavailable(f"mlflow {what}"),
            self.sim.latency.mlflow,
        )

    def start_run(
        self, name: str, *, parent_run_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str:
        def create() -> str:
            run = RunRecord(self.twin.new_id("run"), name, parent_run_id, tags=dict(tags or {}))
            self.twin.runs[run.run_id] = run
            self.sim.trace.event(
                self.sim.now, "mlflow", f"{self.sim.process.name} creates run {run.run_id} ({name})"
            )
            return run.run_id

        return self._call("create_run", create)

    def find_run(self, key: str) -> str | None:
        def find() -> str | None:
            runs = self.twin.runs_with_key(key)
            return runs[0].run_id if runs else None

        return self._call("search_runs", find)

    def set_tags(
        self, run_id: str, tags: Mapping[str, object], *, params: Mapping[str, object] | None = None
    ) -> None:
        self._call("log_batch", lambda: self._write(run_id, tags=tags, params=params))

    def log_batch(
        self,
        run_id: str,
        points: Sequence[MetricPoint],
        tags: Mapping[str, object],
        *,
        params: Mapping[str, object] | None = None,
    ) -> None:
        def log() -> None:
            run = self.twin.runs[run_id]
            for point in points:
                run.log_point(point.key, point.value, point.step or 0, point.timestamp_ms)
            self._write(run_id, tags=tags, params=params)

        self._call("log_batch", log)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self._call("log_artifact", lambda: self.twin.runs[run_id].texts.__setitem__(artifact_file, text))

    def end_run(self, run_id: str, status: RunStatus) -> None:
        def end() -> None:
            self.twin.runs[run_id].status = status
            self.sim.trace.event(
                self.sim.now, "mlflow", f"{self.sim.process.name} ends run {run_id} {status}"
            )

        self._call("set_terminated", end)

    def find_logged_model(self, run_id: str, name: str) -> str | None:
        def find() -> str | None:
            ready = [m for m in self.twin.runs[run_id].models if m[1] == name and m[2] == "READY"]
            return ready[0][0] if ready else None

        return self._call("search_logged_models", find)

    def log_checkpoint_model(
        self, run_id: str, checkpoint: Path, *, name: str, step: int, params: Mapping[str, object]
    ) -> str:
        def log() -> str:
            model_id = self.twin.new_id("m-")
            self.twin.runs[run_id].models.append((model_id, name, "READY"))
            return model_id

        return self._call("log_model", log)

    def run_url(self, run_id: str, ui_url: str) -> str:
        return f"{ui_url}/#/runs/{run_id}"

    def run_is_active(self, run_id: str) -> bool:
        return self._call("get_run", lambda: self.twin.runs[run_id].status == "RUNNING")

    def _write(self, run_id: str, *, tags: Mapping[str, object], params: Mapping[str, object] | None) -> None:
        run = self.twin.runs[run_id]
        run.tags.update({key: str(value) for key, value in tags.items()})
        run.params.update({key: str(value) for key, value in (params or {}).items()})
