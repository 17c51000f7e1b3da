"""The tunepod_* metrics, each test on a fresh CollectorRegistry; the /metrics endpoint over real HTTP;
the Grafana dashboard, the Prometheus config and its alert rules against the metrics that exist."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import FrozenTrial, TrialState
from prometheus_client import CollectorRegistry

from tunepod.hpo.trials import StudyTrials
from tunepod.launch.base import JobState
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import Submission, write_submission
from tunepod.metrics import TRIAL_STATES, TrialObserver, TunepodMetrics, open_pipeline_metrics
from tunepod.runtime.checkpoints import METADATA_FILE, save_checkpoint, saved_checkpoint
from tunepod.runtime.progress import Heartbeat, read_progress
from tunepod.spec.models import MetricsSpec, PipelineSpec
from tunepod.webhook.app import requests_counter

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deployments" / "observability" / "grafana-dashboard.json"
PROMETHEUS_CONFIG = REPO / "deployments" / "observability" / "prometheus.yml"
ALERTS = REPO / "deployments" / "observability" / "alerts.yml"
# The labels of observer_for()'s trials: its run was never opened as a pipeline.
LABELS = {"pipeline": "pipe", "study": "quad", "step": "search"}


class ScriptedJob:
    """A JobHandle whose states follow a script. It stands in for a scheduler's queue: the local
    launcher never shows PENDING, and queue waits are about the PENDING -> RUNNING edge."""

    def __init__(self, job_dir: Path, states: list[JobState]) -> None:
        self.job_id = "scripted-1"
        self.job_dir = job_dir
        self._states = states

    def state(self, *, fresh: bool = False) -> JobState:
        return self._states.pop(0) if len(self._states) > 1 else self._states[0]

    def cancel(self) -> None:
        self._states = [JobState.CANCELLED]

    def logs(self, tail: int = 50) -> str:
        return ""

    def describe(self) -> str:
        return "scripted"


@pytest.fixture
def metrics() -> TunepodMetrics:
    return TunepodMetrics(CollectorRegistry())


def sample(metrics: TunepodMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def observer_for(metrics: TunepodMetrics) -> TrialObserver:
    return metrics.trial_observer(pipeline=LABELS["pipeline"], study="quad", step="search")


def test_staging_adds_bytes_and_observes_seconds_per_step(metrics: TunepodMetrics) -> None:
    metrics.observe_staging("pipe", "data", copied_bytes=1000, seconds=2.5)
    metrics.observe_staging("pipe", "data", copied_bytes=24, seconds=0.5)
    metrics.observe_staging("pipe", "other", copied_bytes=7, seconds=1.0)

    assert sample(metrics, "tunepod_staging_copied_bytes_total", pipeline="pipe", step="data") == 1024
    assert sample(metrics, "tunepod_staging_seconds_count", pipeline="pipe", step="data") == 2
    assert sample(metrics, "tunepod_staging_seconds_sum", pipeline="pipe", step="data") == 3.0
    assert sample(metrics, "tunepod_staging_copied_bytes_total", pipeline="pipe", step="other") == 7


def test_trials_gauge_counts_the_study_in_each_state(metrics: TunepodMetrics) -> None:
    study = optuna.create_study()
    for _ in range(4):
        study.ask()
    study.tell(0, 1.0)
    study.tell(1, state=TrialState.PRUNED)
    study.tell(2, state=TrialState.FAIL)
    observer_for(metrics).count_trials(StudyTrials(study).tally())

    counts = {state: sample(metrics, "tunepod_trials", **LABELS, state=state) for state in TRIAL_STATES}
    assert counts == {"RUNNING": 1, "COMPLETE": 1, "PRUNED": 1, "FAIL": 1}


def test_queue_wait_from_submission_to_first_running_poll(metrics: TunepodMetrics, tmp_path: Path) -> None:
    job = observer_for(metrics).submitted(
        ScriptedJob(tmp_path, [JobState.PENDING, JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED])
    )
    states = [job.state() for _ in range(4)]

    assert states[-1] is JobState.SUCCEEDED
    assert sample(metrics, "tunepod_trial_queue_wait_seconds_count", **LABELS) == 1


def test_reattached_running_job_has_no_queue_wait(metrics: TunepodMetrics, tmp_path: Path) -> None:
    observer = observer_for(metrics)
    observer.attached(ScriptedJob(tmp_path / "a", [JobState.RUNNING])).state()
    assert sample(metrics, "tunepod_trial_queue_wait_seconds_count", **LABELS) is None

    # Seen pending first: its wait counts from when the launcher wrote submission.json.
    paths = JobPaths(tmp_path / "b")
    paths.job_dir.mkdir()
    paths.submission.write_text("{}")
    submitted = time.time() - 100
    os.utime(paths.submission, (submitted, submitted))
    job = observer.attached(ScriptedJob(paths.job_dir, [JobState.PENDING, JobState.RUNNING]))
    job.state()
    job.state()
    assert sample(metrics, "tunepod_trial_queue_wait_seconds_count", **LABELS) == 1
    assert sample(metrics, "tunepod_trial_queue_wait_seconds_sum", **LABELS) >= 100  # type: ignore[operator]


def test_trial_duration_runs_from_first_submission_across_restarts(
    metrics: TunepodMetrics, tmp_path: Path
) -> None:
    observer = observer_for(metrics)
    observer.submitted(ScriptedJob(tmp_path, [JobState.FAILED]))
    time.sleep(0.05)
    observer.submitted(ScriptedJob(tmp_path, [JobState.SUCCEEDED]))  # the restart keeps the first time
    observer.finished(tmp_path, "COMPLETE")
    observer.finished(tmp_path, "COMPLETE")  # nothing in flight any more: not counted twice

    labels = {**LABELS, "state": "COMPLETE"}
    assert sample(metrics, "tunepod_trial_duration_seconds_count", **labels) == 1
    assert sample(metrics, "tunepod_trial_duration_seconds_sum", **labels) >= 0.05  # type: ignore[operator]


def test_checkpoint_save_seconds_come_from_new_checkpoints_metadata(
    metrics: TunepodMetrics, tmp_path: Path
) -> None:
    checkpoints = JobPaths(tmp_path).checkpoints
    save_checkpoint(checkpoints, b"before the submission", 0, keep=5)
    time.sleep(0.01)
    job = observer_for(metrics).attached(ScriptedJob(tmp_path, [JobState.RUNNING]))
    job.state()
    save_checkpoint(checkpoints, b"x" * 1000, 1, keep=5)
    save_checkpoint(checkpoints, b"y" * 1000, 2, keep=5)
    job.state()
    job.state()  # seen once, counted once

    assert sample(metrics, "tunepod_checkpoint_save_seconds_count", **LABELS) == 2
    recorded = [saved_checkpoint(checkpoints / f"step-00000{n}") for n in (1, 2)]
    expected = sum(info.save_seconds for info in recorded if info and info.save_seconds is not None)
    assert sample(metrics, "tunepod_checkpoint_save_seconds_sum", **LABELS) == pytest.approx(expected)


def test_last_progress_is_the_oldest_advance_among_running_jobs_and_absent_when_none_runs(
    metrics: TunepodMetrics, tmp_path: Path
) -> None:
    observer = observer_for(metrics)
    progress = "tunepod_job_last_progress_timestamp_seconds"
    slow_dir, fast_dir = tmp_path / "slow", tmp_path / "fast"
    # Real heartbeat files; a long interval, so each file holds its first beat until finish.
    slow = Heartbeat(JobPaths(slow_dir).progress, 0, interval_s=3600).start()
    time.sleep(0.01)
    fast = Heartbeat(JobPaths(fast_dir).progress, 0, interval_s=3600).start()
    (slow_beat,) = read_progress(JobPaths(slow_dir).progress)
    (fast_beat,) = read_progress(JobPaths(fast_dir).progress)
    running, done = JobState.RUNNING, JobState.SUCCEEDED
    slow_job = observer.submitted(ScriptedJob(slow_dir, [JobState.PENDING, running, running, done]))
    fast_job = observer.submitted(ScriptedJob(fast_dir, [running, done]))
    try:
        slow_job.state()  # queued: not counted, whatever its files say
        assert sample(metrics, progress, **LABELS) is None
        fast_job.state()
        assert sample(metrics, progress, **LABELS) == fast_beat.advanced_at
        slow_job.state()
        assert sample(metrics, progress, **LABELS) == slow_beat.advanced_at < fast_beat.advanced_at
        slow.finish()  # a rank whose loop is over waits legitimately
        slow_job.state()
        assert sample(metrics, progress, **LABELS) == fast_beat.advanced_at
        fast_job.state()
        slow_job.state()
        assert sample(metrics, progress, **LABELS) is None  # nothing runs: nothing can be stuck
    finally:
        slow.finish()
        fast.finish()


def rank_series(metrics: TunepodMetrics) -> dict[tuple[str, str, str], float]:
    """Every tunepod_rank_* sample, as {(metric, trial, rank): value}."""
    return {
        (sample.name, sample.labels["trial"], sample.labels["rank"]): sample.value
        for family in metrics.registry.collect()
        if family.name.startswith("tunepod_rank_")
        for sample in family.samples
    }


def test_each_running_ranks_telemetry_is_a_gauge_per_rank_removed_when_the_job_ends(
    metrics: TunepodMetrics, tmp_path: Path
) -> None:
    """Real heartbeat threads of two ranks of one trial write their telemetry; each poll of the
    running job sets one series per rank and figure, and the series go when the job ends."""
    observer = observer_for(metrics)
    job_dir = tmp_path / "trial-7"
    folder = JobPaths(job_dir).progress
    ranks = [Heartbeat(folder, rank, interval_s=3600).start() for rank in (0, 1)]
    for step in range(3):
        ranks[0].step_done(step, samples=4, tokens=40)
        ranks[1].step_done(step, samples=4)  # counts no tokens: no tokens series
    untimed = Heartbeat(JobPaths(tmp_path / "trial-8").progress, 0, interval_s=3600).start()
    running, done = JobState.RUNNING, JobState.SUCCEEDED
    job = observer.submitted(ScriptedJob(job_dir, [running, running, done]))
    other = observer.submitted(ScriptedJob(tmp_path / "trial-8", [running]))
    try:
        job.state()  # first beats only: no step measured yet
        assert rank_series(metrics) == {}
        for beat in ranks:
            beat.finish()  # the last beat carries the window
        job.state()
        other.state()  # a script that never calls step_done: no series
        beats = {beat.rank: beat.telemetry for beat in read_progress(folder)}
        assert beats[0] is not None and beats[1] is not None
        assert rank_series(metrics) == {
            ("tunepod_rank_step_seconds", "trial-7", "0"): beats[0].step_time_s,
            ("tunepod_rank_step_seconds", "trial-7", "1"): beats[1].step_time_s,
            ("tunepod_rank_samples_per_second", "trial-7", "0"): beats[0].samples_per_s,
            ("tunepod_rank_samples_per_second", "trial-7", "1"): beats[1].samples_per_s,
            ("tunepod_rank_tokens_per_second", "trial-7", "0"): beats[0].tokens_per_s,
            ("tunepod_rank_peak_memory_bytes", "trial-7", "0"): beats[0].peak_memory_bytes,
            ("tunepod_rank_peak_memory_bytes", "trial-7", "1"): beats[1].peak_memory_bytes,
            ("tunepod_rank_cpu_busy_ratio", "trial-7", "0"): beats[0].cpu_busy,
            ("tunepod_rank_cpu_busy_ratio", "trial-7", "1"): beats[1].cpu_busy,
        }
        assert sample(metrics, "tunepod_rank_step_seconds", **LABELS, trial="trial-7", rank="0") is not None
        job.state()  # ended
        assert rank_series(metrics) == {}
    finally:
        for beat in [*ranks, untimed]:
            beat.finish()


def test_restarts_count_the_submissions_whose_record_says_a_later_attempt(
    metrics: TunepodMetrics, tmp_path: Path
) -> None:
    observer = observer_for(metrics)
    restarts = "tunepod_job_restarts_total"
    assert sample(metrics, restarts, **LABELS) == 0  # from zero, so increase() sees the first one
    paths = JobPaths(tmp_path)
    for attempt in (1, 2, 3):
        record = Submission(
            backend="local", name="t", attempt=attempt, submission_id="s", job_id="1", intent_at="now"
        )
        write_submission(paths, record)
        observer.submitted(ScriptedJob(tmp_path, [JobState.RUNNING]))
    observer.attached(ScriptedJob(tmp_path, [JobState.RUNNING]))  # a re-attach is no restart

    assert sample(metrics, restarts, **LABELS) == 2


def test_last_completed_is_the_study_s_last_completion_or_the_step_s_start(
    metrics: TunepodMetrics,
) -> None:
    last_completed = "tunepod_study_last_completed_timestamp_seconds"
    study = optuna.create_study()
    day_ago = datetime.now() - timedelta(days=1)  # Optuna's datetimes are naive local times
    study.add_trial(  # a resumed study, whose last trial completed long ago
        FrozenTrial(
            number=0,
            state=TrialState.COMPLETE,
            value=1.0,
            datetime_start=day_ago,
            datetime_complete=day_ago,
            params={},
            distributions={},
            user_attrs={},
            system_attrs={},
            intermediate_values={},
            trial_id=0,
        )
    )
    before = time.time()
    observer = observer_for(metrics)
    after = time.time()
    trials = StudyTrials(study)
    study.tell(study.ask(), state=TrialState.FAIL)
    observer.count_trials(trials.tally())
    assert before <= sample(metrics, last_completed, **LABELS) <= after  # type: ignore[operator]

    study.tell(study.ask(), 0.5)
    observer.count_trials(trials.tally())
    completed_at = study.trials[-1].datetime_complete
    assert completed_at is not None
    assert sample(metrics, last_completed, **LABELS) == completed_at.timestamp()


def test_checkpoint_metadata_records_save_seconds_and_older_ones_read_as_none(tmp_path: Path) -> None:
    folder = save_checkpoint(tmp_path, {"w": [1.0, 2.0]}, 3, keep=2)
    info = saved_checkpoint(folder)
    assert info is not None and info.save_seconds is not None and info.save_seconds >= 0

    metadata = json.loads((folder / METADATA_FILE).read_text())
    del metadata["save_seconds"]
    (folder / METADATA_FILE).write_text(json.dumps(metadata))
    older = saved_checkpoint(folder)
    assert older is not None and older.step == 3 and older.save_seconds is None


def test_endpoint_serves_the_metrics_while_open_and_stops_on_close() -> None:
    opened = open_pipeline_metrics(MetricsSpec(port=0), pipeline="served", run_id="run-served")
    assert opened.url is not None
    url = opened.url
    try:
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "# TYPE tunepod_trials gauge" in body
        assert "# TYPE tunepod_trial_queue_wait_seconds histogram" in body
    finally:
        opened.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def test_a_busy_port_leaves_the_run_without_an_endpoint() -> None:
    first = open_pipeline_metrics(MetricsSpec(port=0), pipeline="a", run_id="run-a")
    try:
        assert first.server is not None
        busy = MetricsSpec(port=first.server.server_port)
        second = open_pipeline_metrics(busy, pipeline="b", run_id="run-b")
        assert second.url is None
        second.close()
    finally:
        first.close()


def test_spec_takes_an_optional_metrics_block() -> None:
    base = {
        "name": "p",
        "tracking": {"experiment": "e"},
        "steps": {"s": {"uses": "stage", "with": {"source": "a", "target": "b"}}},
    }
    assert PipelineSpec.model_validate(base).metrics is None
    spec = PipelineSpec.model_validate({**base, "metrics": {"port": 9464, "linger_s": 5}})
    assert spec.metrics == MetricsSpec(port=9464, host="127.0.0.1", linger_s=5)
    with pytest.raises(ValueError, match="prot"):
        PipelineSpec.model_validate({**base, "metrics": {"prot": 9464}})


# ---------------------------------------------------------------------------------------------- deployments


def exposed_names(metrics: TunepodMetrics) -> set[str]:
    """Every series name the registry can expose (a histogram's _bucket/_sum/_count, a counter's _total)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in metrics.registry.collect() for suffix in suffixes[family.type]}


# The GPU and node exporters' series the dashboard shows beside tunepod's (NVIDIA's dcgm-exporter
# default counters, the node exporter's netdev, meminfo and infiniband collectors).
EXPORTER_METRICS = {
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_POWER_USAGE",
    "node_network_receive_bytes_total",
    "node_network_transmit_bytes_total",
    "node_infiniband_port_data_received_bytes_total",
    "node_infiniband_port_data_transmitted_bytes_total",
    "node_memory_MemTotal_bytes",
    "node_memory_MemAvailable_bytes",
}


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}


def series_names(expr: str) -> set[str]:
    """The series an expression reads: its identifiers once strings, label matchers, ranges and
    grouping lists are cut out, less functions (followed by a parenthesis) and PromQL's keywords; of
    a variable's ``label_values(series, label)``, the series."""
    if expr.startswith("label_values("):
        return {re.split(r"[{,)]", expr.removeprefix("label_values("))[0].strip()}
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", bare)
    words = re.findall(r"\b([A-Za-z_:][A-Za-z0-9_:]*)\b(?!\s*\()", bare)
    return {word for word in words if word not in PROMQL_WORDS}


def dashboard_exprs() -> list[str]:
    """Every query of the dashboard: its panels' (rows have none) and its variables'."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return panels + variables


def test_every_dashboard_expr_uses_a_metric_that_exists(metrics: TunepodMetrics) -> None:
    requests_counter(metrics.registry)  # the webhook receiver's counter is on the dashboard too
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs()
    used = {name for expr in exprs for name in re.findall(r"\btunepod_[a-z_]+", expr)}
    names = exposed_names(metrics)
    series = {name for expr in exprs for name in series_names(expr)}
    rank_metrics = {name for name in names if name.startswith("tunepod_rank_")}

    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    assert used - names == set()
    # Every series an expression reads is tunepod's, an exporter's the dashboard shows, or up.
    assert series - names - EXPORTER_METRICS - {"up"} == set()
    assert series >= EXPORTER_METRICS
    assert len(rank_metrics) == 5 and rank_metrics <= series
    # Each metric has a panel.
    families = {family.name for family in metrics.registry.collect()}
    assert {f for f in families if not any(name.startswith(f) for name in used)} == set()


def test_prometheus_config_scrapes_the_pipeline_and_the_webhook_receiver() -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {
        name: [t for group in job["static_configs"] for t in group["targets"]] for name, job in jobs.items()
    }
    assert targets == {"tunepod-pipeline": ["127.0.0.1:9464"], "tunepod-webhook": ["127.0.0.1:8787"]}
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())
    assert MetricsSpec().port == 9464  # the default the pipeline target points at


def test_the_config_loads_the_alert_rules_and_they_watch_metrics_that_exist(metrics: TunepodMetrics) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    # Relative to the config file: the folder works wherever it is copied.
    assert [PROMETHEUS_CONFIG.parent / path for path in config["rule_files"]] == [ALERTS]
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    used = {name for rule in rules for name in re.findall(r"\btunepod_[a-z_]+", rule["expr"])}

    assert {rule["alert"] for rule in rules} == {
        "TunepodTrialWithoutProgress",
        "TunepodJobRestartLoop",
        "TunepodStudyWithoutCompletedTrial",
    }
    assert used - exposed_names(metrics) == set()
    assert all({"summary", "description", "runbook"} <= set(rule["annotations"]) for rule in rules)
