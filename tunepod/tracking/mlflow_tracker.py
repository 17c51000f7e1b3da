"""``MlflowTracker``: the pipeline's whole MLflow vocabulary behind one small class."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from tunepod.errors import TunepodError
from tunepod.stores import opening_store, redacted, schema_lock, sync_sqlalchemy_url
from tunepod.tracking import tags as tag_names
from tunepod.tracking.sqlite_store import seed_new_store, use_write_ahead_log

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
# MLflow caps a param value at 6000 characters; longer values are cut rather than rejected.
MAX_PARAM_CHARS = 6000
# log_batch takes at most 1000 entities, at most 100 of them tags and 100 params.
_BATCH_TAGS = 100
_BATCH_PARAMS = 100
_BATCH_METRICS = 1000 - _BATCH_TAGS - _BATCH_PARAMS


@dataclass(frozen=True)
class Point:
    """One metric value at one step."""

    key: str
    value: float
    step: int | None
    timestamp_ms: int
    """Fixed by the caller, so a retried write is the same point, not a second one."""
    model_id: str | None = None


class MetricPoint(Protocol):
    """One metric value at one step (``Point`` of the mirror is one)."""

    @property
    def key(self) -> str: ...
    @property
    def value(self) -> float: ...
    @property
    def step(self) -> int | None: ...
    @property
    def timestamp_ms(self) -> int: ...
    @property
    def model_id(self) -> str | None: ...


class RunTracker(Protocol):
    """What the tuning loop and the run mirrors ask of MLflow: ``MlflowTracker`` is one; the
    lifecycle simulation's tracking store twin is another, checked against this by the type checker."""

    @property
    def tracking_uri(self) -> str: ...

    def start_run(
        self, name: str, *, parent_run_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str: ...

    def find_run(self, key: str) -> str | None: ...

    def set_tags(
        self, run_id: str, tags: Mapping[str, object], *, params: Mapping[str, object] | None = None
    ) -> None: ...

    def log_batch(
        self,
        run_id: str,
        points: Sequence[MetricPoint],
        tags: Mapping[str, object],
        *,
        params: Mapping[str, object] | None = None,
    ) -> None: ...

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None: ...

    def end_run(self, run_id: str, status: RunStatus) -> None: ...

    def run_is_active(self, run_id: str) -> bool: ...

    def run_url(self, run_id: str, ui_url: str) -> str: ...

    def find_logged_model(self, run_id: str, name: str) -> str | None: ...

    def log_checkpoint_model(
        self, run_id: str, checkpoint: Path, *, name: str, step: int, params: Mapping[str, object]
    ) -> str: ...


def absolute_tracking_uri(uri: str) -> str:
    """Jobs run in other directories (or on other machines): hand them an absolute SQLite path. A
    PostgreSQL store is opened through psycopg 3 (``postgresql://`` would mean psycopg2)."""
    if not uri.startswith("sqlite:///"):
        return sync_sqlalchemy_url(uri)
    return f"sqlite:///{Path(uri[len('sqlite:///') :]).expanduser().resolve()}"


def artifact_root_for(tracking_uri: str, experiment: str) -> str | None:
    """Keep artifacts beside a local SQLite store (not in ./mlruns of whatever directory we run in)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None  # a tracking server decides where artifacts go
    db = Path(tracking_uri[len("sqlite:///") :]).expanduser().resolve()
    return (db.parent / "mlartifacts" / experiment).as_uri()


class MlflowTracker:
    """Creates and updates the runs of one experiment. Thread safe: it holds no per-run state."""

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        from mlflow import MlflowClient

        # A store that cannot be opened is a StoreError that quotes neither the URI nor its password
        # (MLflow's own message quotes the URI with it).
        with opening_store("the MLflow tracking store", "tracking.uri", tracking_uri):
            tracking_uri = absolute_tracking_uri(tracking_uri)
            self.tracking_uri = tracking_uri
            with schema_lock(tracking_uri, "mlflow"):
                # Opening a database store creates (or migrates) its tables: two pipelines starting at
                # once on a new store would both run the migration and one fail, or break the store.
                seed_new_store(tracking_uri)  # a new SQLite store: a copy of a cached empty one
                use_write_ahead_log(tracking_uri)  # a SQLite store on a local disk: faster commits
                self.client: MlflowClient = MlflowClient(tracking_uri)
                self.experiment_id = self._experiment_id(experiment)

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                raise TunepodError(
                    f"MLflow experiment {name!r} is deleted in {redacted(self.tracking_uri)}; fix: restore "
                    f"it (mlflow experiments restore) or choose another tracking.experiment"
                )
            return str(found.experiment_id)
        from mlflow.exceptions import MlflowException

        artifact_root = artifact_root_for(self.tracking_uri, name)
        try:
            return str(self.client.create_experiment(name, artifact_location=artifact_root))
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            # Another pipeline created it between our look and our create.
            created = self.client.get_experiment_by_name(name)
            if created is None:
                raise
            return str(created.experiment_id)

    # ------------------------------------------------------------------------------------------ runs

    def start_run(
        self,
        name: str,
        *,
        parent_run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> str:
        """A new run; its params are logged later, with its job's tags (``set_tags``) or its outcome."""
        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags[tag_names.PARENT_RUN] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return str(run.info.run_id)

    def set_tags(
        self, run_id: str, tags: Mapping[str, object], *, params: Mapping[str, object] | None = None
    ) -> None:
        """A run's tags, and ``params`` with them in the same write (a param logged again with the
        same value is no change)."""
        self.log_batch(run_id, (), tags, params=params)

    def log_metric(
        self,
        run_id: str,
        key: str,
        value: float,
        *,
        step: int | None = None,
        model_id: str | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        """Log one point. A retried call with the same ``timestamp_ms`` writes the same point again,
        which MLflow stores once."""
        timestamp = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
        self.client.log_metric(run_id, key, value, timestamp=timestamp, step=step, model_id=model_id)

    def log_values(
        self, run_id: str, values: Mapping[str, float], *, tags: Mapping[str, object] | None = None
    ) -> None:
        """Metrics of a run (each one point at step 0, now) and its tags, in one write (a stage step
        logging five figures and a tag used to cost six round trips to a tracking server)."""
        now = int(time.time() * 1000)
        points = [Point(key, float(value), None, now) for key, value in values.items()]
        self.log_batch(run_id, points, tags or {})

    def log_batch(
        self,
        run_id: str,
        points: Sequence[MetricPoint],
        tags: Mapping[str, object],
        *,
        params: Mapping[str, object] | None = None,
    ) -> None:
        """A run's metric points, tags and params in one write where MLflow's limits allow (100 params,
        100 tags, 1000 in all), else as many as they need. Each point's timestamp is the caller's, so
        a retried call writes the same points, which MLflow stores once; a tag or param logged again
        with the same value is no change."""
        from mlflow.entities import Metric, Param, RunTag

        metrics = [Metric(p.key, p.value, p.timestamp_ms, p.step or 0, model_id=p.model_id) for p in points]
        run_tags = [RunTag(k, str(v)) for k, v in tags.items()]
        items = [Param(str(k), str(v)[:MAX_PARAM_CHARS]) for k, v in (params or {}).items()]
        while metrics or run_tags or items:
            self.client.log_batch(
                run_id,
                metrics=metrics[:_BATCH_METRICS],
                tags=run_tags[:_BATCH_TAGS],
                params=items[:_BATCH_PARAMS],
            )
            metrics, run_tags, items = metrics[_BATCH_METRICS:], run_tags[_BATCH_TAGS:], items[_BATCH_PARAMS:]

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_bytes(self, run_id: str, data: bytes, artifact_file: str) -> None:
        """A file artifact (a PNG plot: MLflow shows it by its extension); rewritten when logged again."""
        folder, _, name = artifact_file.rpartition("/")
        with tempfile.TemporaryDirectory(prefix="tunepod-artifact-") as tmp:
            local = Path(tmp, name)
            local.write_bytes(data)
            self.client.log_artifact(run_id, str(local), artifact_path=folder or None)

    def log_table(self, run_id: str, columns: Mapping[str, list[object]], artifact_file: str) -> None:
        """A table artifact (``.json``), shown as a table in the MLflow UI; rewritten when logged again."""
        self.client.log_table(run_id, dict(columns), artifact_file)

    def end_run(self, run_id: str, status: RunStatus) -> None:
        self.client.set_terminated(run_id, status=status)

    def delete_run(self, run_id: str) -> None:
        """Delete a run (MLflow keeps it out of searches and the UI); one gone already is no error."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_run(run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise

    def run_is_active(self, run_id: str) -> bool:
        """Whether the run takes writes: MLflow refuses every write to a deleted run with the error it
        gives for a name it does not take (``INVALID_PARAMETER_VALUE``)."""
        return str(self.client.get_run(run_id).info.lifecycle_stage) == "active"

    def find_runs(self, filter_string: str) -> list[Any]:
        return list(self.client.search_runs([self.experiment_id], filter_string=filter_string))

    def find_run(self, key: str) -> str | None:
        """The run tagged ``tunepod.key = key`` in this experiment (the oldest, should there be two)."""
        runs = self.find_runs(f"tags.`{tag_names.KEY}` = '{_quoted(key)}'")
        return str(min(runs, key=lambda run: run.info.start_time).info.run_id) if runs else None

    def run_url(self, run_id: str, ui_url: str) -> str:
        return f"{ui_url.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"

    # ------------------------------------------------------------------------------------------ models

    def log_checkpoint_model(
        self, run_id: str, checkpoint: Path, *, name: str, step: int, params: Mapping[str, object]
    ) -> str:
        """Log one checkpoint folder as an MLflow logged model of ``run_id``; returns its model id."""
        model = self.client.create_logged_model(
            self.experiment_id,
            name=name,
            source_run_id=run_id,
            tags={tag_names.MODEL_STEP: str(step), tag_names.MODEL_CHECKPOINT: str(checkpoint)},
            params={str(k): str(v)[:MAX_PARAM_CHARS] for k, v in params.items()},
        )
        try:
            self.client.log_model_artifacts(model.model_id, str(checkpoint))
        except Exception:
            self.client.finalize_logged_model(model.model_id, "FAILED")
            raise
        self.client.finalize_logged_model(model.model_id, "READY")
        return str(model.model_id)

    def find_logged_model(self, run_id: str, name: str) -> str | None:
        """The READY logged model ``name`` of ``run_id``, if one was logged already."""
        found = self.client.search_logged_models(
            [self.experiment_id],
            filter_string=f"source_run_id = '{_quoted(run_id)}' AND name = '{_quoted(name)}'",
        )
        ready = [model for model in found if str(model.status).endswith("READY")]
        return str(ready[0].model_id) if ready else None

    def register(self, model_id: str, name: str, tags: Mapping[str, str]) -> str:
        """The version of registered model ``name`` made from logged model ``model_id``: the existing
        one when this model was registered before (a retried or rerun step), else a new one."""
        import mlflow

        existing = self.version_of(name, model_id)
        if existing is not None:
            return existing
        mlflow.set_tracking_uri(self.tracking_uri)
        version = mlflow.register_model(
            f"models:/{model_id}", name, tags={**tags, tag_names.SOURCE_MODEL: model_id}
        )
        return str(version.version)

    def version_of(self, name: str, model_id: str) -> str | None:
        """The version of registered model ``name`` registered from ``model_id``, if any."""
        from mlflow.exceptions import MlflowException

        try:
            versions = self.client.search_model_versions(f"name = '{_quoted(name)}'")
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND"):
                return None
            raise
        mine = [v for v in versions if v.model_id == model_id or v.source == f"models:/{model_id}"]
        return str(min(int(v.version) for v in mine)) if mine else None

    def alias_holder(self, name: str, alias: str) -> tuple[str, dict[str, str]] | None:
        """The version the alias points at and its tags, or None if there is no such alias (or model)."""
        from mlflow.exceptions import MlflowException

        try:
            version = self.client.get_model_version_by_alias(name, alias)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                return None
            raise
        return str(version.version), dict(version.tags)

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, version)


def _quoted(value: str) -> str:
    """``value`` inside a single-quoted MLflow filter string."""
    return value.replace("'", "\\'")
