"""A real Prometheus scrapes a real tune: torchrun trials on the local launcher, the pipeline's /metrics
endpoint, and the tunepod_* series read back through Prometheus' HTTP API, the ranks' telemetry among
them (and in the trials' MLflow runs); every query of the shipped Grafana dashboard runs against it.
The same Prometheus scrapes a real node exporter and a dcgm-exporter sample, so that the dashboard's
GPU and node panels are checked to return data: the DCGM series come from a written sample
(``tests/fixtures/observability/dcgm-exporter-metrics.txt``, served over HTTP) because there is no
GPU here, while the node exporter is Debian's, run for real. The shipped alert rules are checked and
unit-tested with promtool, and loaded by the real Prometheus, which fires one of them on a real
stalled trial.

Needs Debian's prometheus and prometheus-node-exporter (``scripts/prometheus-up``, which ``make test``
runs): without them these tests skip with the reason, except under ``CI=true``, where a skip would
hide a broken setup, so they fail.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from needs import skip_or_fail
from ports import free_port
from test_tuner import PIPELINE, child_runs, make_tuner, settings

from tunepod.metrics import open_pipeline_metrics
from tunepod.runtime.progress import HEARTBEAT_S_ENV
from tunepod.spec.models import MetricsSpec

PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")
NODE_EXPORTER = Path("/usr/bin/prometheus-node-exporter")
REPO = Path(__file__).resolve().parents[2]
OBSERVABILITY = REPO / "deployments" / "observability"
ALERTS = OBSERVABILITY / "alerts.yml"
STALL = REPO / "tests" / "fixtures" / "trainers" / "stall.py"
RANKS = REPO / "tests" / "fixtures" / "trainers" / "ranks.py"
DASHBOARD = OBSERVABILITY / "grafana-dashboard.json"
# dcgm-exporter's /metrics as it would read on a node of two GPUs: written, not recorded from a live
# GPU (there is none here); see its header.
DCGM_SAMPLE = REPO / "tests" / "fixtures" / "observability" / "dcgm-exporter-metrics.txt"
TELEMETRY = ("step_seconds", "samples_per_second", "tokens_per_second", "peak_memory_bytes", "cpu_busy_ratio")
STUDY = "prom-quad"
NUM_TRIALS = 3
EPOCHS = 2
# Bounds on waiting for Prometheus, never assertions about speed.
READY_TIMEOUT_S = 60.0
QUERY_TIMEOUT_S = 60.0


def require(tool: Path) -> None:
    if tool.exists():
        return
    package = "prometheus-node-exporter" if tool == NODE_EXPORTER else "prometheus"
    reason = f"{tool} is missing: install Debian's {package} with scripts/prometheus-up (make test runs it)"
    skip_or_fail(reason)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_until_answering(
    url: str, process: subprocess.Popen[bytes], what: str, log_tail: Callable[[], str]
) -> None:
    """Wait until ``url`` answers 200 (``what``, started as ``process``, is up); fail with its log's
    tail if it exits first or does not answer within ``READY_TIMEOUT_S``."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{what} exited: {log_tail()}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    pytest.fail(f"{what} did not answer {url} after {READY_TIMEOUT_S} s: {log_tail()}")


class Prometheus:
    """A Prometheus server on a loopback port, scraping ``target`` (job tunepod-pipeline) and the
    ``exporters`` ({job: target}, if any) and evaluating ``rules`` (if any) every second; stopped on
    ``stop``."""

    def __init__(
        self, tmp_path: Path, target: str, rules: Path | None = None, exporters: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "prometheus.log"
        config = tmp_path / "prometheus.yml"
        jobs = {"tunepod-pipeline": target, **(exporters or {})}
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            + (f"rule_files: ['{rules}']\n" if rules is not None else "")
            + "scrape_configs:\n"
            + "".join(
                f"  - job_name: {job}\n    static_configs: [{{targets: ['{address}']}}]\n"
                for job, address in jobs.items()
            )
        )
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    str(PROMETHEUS),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> None:
        wait_until_answering(f"{self.url}/-/ready", self.process, "prometheus", self.log_tail)

    def query(self, promql: str) -> dict[str, float]:
        """The instant vector ``promql`` as {value of its single varying label (or ''): value}."""
        result = self.answer(promql)["result"]
        return {"".join(item["metric"].values()): float(item["value"][1]) for item in result}

    def answer(self, promql: str) -> Any:
        """Prometheus' answer to the instant query ``promql`` (its ``data``), which must succeed."""
        answer = get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert answer["status"] == "success", answer
        return answer["data"]

    def answer_with_data(self, promql: str) -> list[Any]:
        """The result of the instant query ``promql`` once it is not empty (bounded: a rate needs two
        scrapes); empty if it stays so."""
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while not (result := self.answer(promql)["result"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        return list(result)

    def query_until(self, promql: str, expected: dict[str, float]) -> dict[str, float]:
        """Poll ``promql`` (bounded) until it equals ``expected``; returns the last answer."""
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while (seen := self.query(promql)) != expected and time.monotonic() < deadline:
            time.sleep(0.5)
        return seen

    def alert_names(self) -> set[str]:
        """The alerting rules Prometheus loaded."""
        groups = get_json(f"{self.url}/api/v1/rules?type=alert")["data"]["groups"]
        return {rule["name"] for group in groups for rule in group["rules"]}

    def wait_firing(self, alert: str, study: str, running: Future[Any]) -> dict[str, Any]:
        """The alert ``alert`` of ``study`` once Prometheus says it fires (bounded; fails at once when
        the tune ``running`` ends first, since nothing could fire it any more)."""
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while time.monotonic() < deadline:
            for seen in get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"]:
                named = seen["labels"]["alertname"] == alert and seen["labels"].get("study") == study
                if named and seen["state"] == "firing":
                    return dict(seen)
            assert not running.done(), f"the tune ended before {alert} fired: {running.exception()}"
            time.sleep(0.5)
        pytest.fail(f"{alert} did not fire within {QUERY_TIMEOUT_S} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Callable[..., Prometheus]]:
    """Starts a Prometheus scraping the given target (once it answers ready); stops it afterwards."""
    require(PROMETHEUS)
    started: list[Prometheus] = []

    def start(target: str, rules: Path | None = None, exporters: dict[str, str] | None = None) -> Prometheus:
        server = Prometheus(tmp_path, target, rules, exporters)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


class NodeExporter:
    """Debian's node exporter on a loopback port, with only the collectors the dashboard reads:
    meminfo, netdev and infiniband (the defaults add some 40 more, each read every second here for
    nothing); stopped on ``stop``."""

    def __init__(self, tmp_path: Path) -> None:
        self.target = f"127.0.0.1:{free_port()}"
        self.log = tmp_path / "node-exporter.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    str(NODE_EXPORTER),
                    f"--web.listen-address={self.target}",
                    "--collector.disable-defaults",
                    "--collector.meminfo",
                    "--collector.netdev",
                    "--collector.infiniband",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> None:
        url = f"http://{self.target}/metrics"
        wait_until_answering(url, self.process, "the node exporter", self.log_tail)

    def log_tail(self) -> str:
        return self.log.read_text()[-2000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)


def serve_metrics(body: bytes) -> ThreadingHTTPServer:
    """An HTTP server on a loopback port that answers ``GET /metrics`` with ``body`` in Prometheus'
    text format, as an exporter does; stop it with ``shutdown``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape a second

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="dcgm-sample", daemon=True).start()
    return server


@pytest.fixture
def exporters(tmp_path: Path) -> Iterator[dict[str, str]]:
    """What feeds the dashboard's "GPUs and nodes" row, as {job: target} for Prometheus: a real node
    exporter, and the dcgm-exporter sample served over HTTP (there is no GPU here, so no real
    dcgm-exporter); both stopped afterwards."""
    require(NODE_EXPORTER)
    node = NodeExporter(tmp_path)
    dcgm = serve_metrics(DCGM_SAMPLE.read_bytes())
    try:
        node.wait_ready()
        yield {"node-exporter": node.target, "dcgm-exporter": f"127.0.0.1:{dcgm.server_port}"}
    finally:
        dcgm.shutdown()
        dcgm.server_close()
        node.stop()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MLflow store and study journal for the module's tunes, each on its own study: creating an
    MLflow store takes seconds."""
    return tmp_path_factory.mktemp("tunes")


def test_a_tune_is_scraped_and_its_metrics_read_back_through_prometheus(
    workspace: Path,
    prometheus_for: Callable[..., Prometheus],
    exporters: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trials of 2 ranks that call ctx.step_done: while the first ones wait after their first epoch,
    each rank's telemetry is read back through Prometheus, and every dashboard query runs, its GPU
    and node panels with data: the node exporter is real, the DCGM series come from a written
    dcgm-exporter sample because there is no GPU here. Once the tune is over, the per-rank series are
    gone and each trial's MLflow run holds every rank's figures."""
    monkeypatch.setenv(HEARTBEAT_S_ENV, "0.2")  # the local jobs' environment: telemetry beats soon
    release = workspace / f"{STUDY}.release"
    train = {
        "entrypoint": str(RANKS),
        "args": {"epochs": EPOCHS, "release": str(release)},
        "resources": {"num_nodes": 1, "procs_per_node": 2},
    }
    tune = settings(workspace, study={"name": STUDY}, num_trials=NUM_TRIALS, train=train)
    tuner = make_tuner(workspace, tune)
    endpoint = open_pipeline_metrics(MetricsSpec(port=0), pipeline=PIPELINE, run_id=tuner.ctx.parent_run_id)
    try:
        assert endpoint.server is not None
        prometheus = prometheus_for(f"127.0.0.1:{endpoint.server.server_port}", exporters=exporters)
        where = f'pipeline="{PIPELINE}", study="{STUDY}", step="search"'
        first = f'{where}, trial="trial-0"'
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(tuner.run)
            try:
                # trial-0 waits after its first epoch: each of its 2 ranks has its 5 series.
                per_rank = f'count by (rank) ({{__name__=~"tunepod_rank_.*", {first}}})'
                assert prometheus.query_until(per_rank, {"0": 5, "1": 5}) == {"0": 5, "1": 5}, running
                # Each step counts 4 samples and 32 tokens: the rates of one window keep that ratio.
                ratio = (
                    f"sum by (rank) (tunepod_rank_tokens_per_second{{{first}}})"
                    f" / sum by (rank) (tunepod_rank_samples_per_second{{{first}}})"
                )
                eight = {"0": pytest.approx(8), "1": pytest.approx(8)}
                assert prometheus.query_until(ratio, eight) == eight
                for name in TELEMETRY:
                    values = prometheus.query(f"tunepod_rank_{name}{{{first}}}").values()
                    # The ranks sleep through their steps: their CPU busy may round to 0.
                    assert len(values) == 2 and all(v > 0 or name == "cpu_busy_ratio" for v in values)
                dashboard_queries_run(prometheus)
            finally:
                release.touch()  # the trials go on and complete
            trials = running.result(timeout=QUERY_TIMEOUT_S * 3)
        assert [t.outcome for t in trials.trials] == ["COMPLETE"] * NUM_TRIALS

        by_state = prometheus.query_until(
            f"sum by (state) (tunepod_trials{{{where}}})",
            {"RUNNING": 0, "COMPLETE": NUM_TRIALS, "PRUNED": 0, "FAIL": 0},
        )
        assert by_state == {"RUNNING": 0, "COMPLETE": NUM_TRIALS, "PRUNED": 0, "FAIL": 0}
        durations = prometheus.query(f"sum by (state) (tunepod_trial_duration_seconds_count{{{where}}})")
        assert durations == {"COMPLETE": NUM_TRIALS}
        assert prometheus.query(f"sum(tunepod_trial_queue_wait_seconds_count{{{where}}})") == {"": NUM_TRIALS}
        # Every trial's final checkpoint exists when its job ends, so each is seen at least once; one
        # saved and pruned between two polls may be missed, so no more than every epoch's.
        (saves,) = prometheus.query(f"sum(tunepod_checkpoint_save_seconds_count{{{where}}})").values()
        assert NUM_TRIALS <= saves <= NUM_TRIALS * EPOCHS
        (seconds,) = prometheus.query(f"sum(tunepod_trial_duration_seconds_sum{{{where}}})").values()
        assert seconds > 0
        assert prometheus.query(f"sum(tunepod_job_restarts_total{{{where}}})") == {"": 0}
        last_completed = f"max(tunepod_study_last_completed_timestamp_seconds{{{where}}})"
        completions = [t.datetime_complete for t in tuner.study.get_trials() if t.datetime_complete]
        assert prometheus.query(last_completed) == {"": pytest.approx(max(completions).timestamp())}
        # Nothing runs any more: no rank series is left behind.
        assert prometheus.query_until(f'{{__name__=~"tunepod_rank_.*", {where}}}', {}) == {}

        runs = [
            r
            for r in child_runs(workspace, tuner.ctx.parent_run_id)
            if r.data.tags.get("tunepod.study") == STUDY
        ]
        assert len(runs) == NUM_TRIALS
        for run in runs:
            metrics = run.data.metrics
            for rank in (0, 1):
                figures = ("step_time_s", "samples_per_s", "tokens_per_s", "cpu_busy")
                assert {f"rank{rank}/{name}" for name in figures} <= set(metrics)
                assert metrics[f"rank{rank}/peak_memory_bytes"] > 0
                assert metrics[f"rank{rank}/tokens_per_s"] == pytest.approx(
                    8 * metrics[f"rank{rank}/samples_per_s"]
                )
    finally:
        endpoint.close()


# Panels that must have data here, by the series their queries read: the tune's per-rank telemetry,
# the GPU panels (DCGM series from the written dcgm-exporter sample: there is no GPU here), and node
# memory and Ethernet traffic (the real node exporter). The EFA/InfiniBand panel (node_infiniband_*)
# cannot have data here: this machine has no InfiniBand device (EFA shows as one), so the node
# exporter's infiniband collector exports nothing, and its queries are only checked to be ones
# Prometheus runs, like those of the pipeline's panels that have nothing to show yet.
FED_HERE = {
    "tunepod_rank_": "the tune's ranks",
    "DCGM_FI_DEV_": "the dcgm-exporter sample served here (a written sample: there is no GPU here)",
    "node_memory_": "the node exporter run here",
    "node_network_": "the node exporter run here",
}


def dashboard_queries_run(prometheus: Prometheus) -> None:
    """Every query of the shipped dashboard, its variables set to match everything, is one that
    Prometheus runs; the per-rank, GPU, node memory and Ethernet panels have data, each series with
    the labels its legend names (the DCGM series come from a sample: there is no GPU here). The
    EFA/InfiniBand panel has none here (see ``FED_HERE``)."""
    dashboard = json.loads(DASHBOARD.read_text())
    ethernet_filter_keeps_this_machines_interfaces(prometheus, dashboard)
    substitutes = {
        "$pipeline": ".*",
        "$study": ".*",
        "$trial": ".*",
        "$__rate_interval": "1m",
        "$__range": "5m",
    }
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in substitutes.items():
                expr = expr.replace(variable, value)
            fed_by = [source for series, source in FED_HERE.items() if series in expr]
            if not fed_by:
                prometheus.answer(expr)  # it runs; it may have no data here
                continue
            result = prometheus.answer_with_data(expr)  # bounded: a rate needs two scrapes
            assert result, f"panel {panel['title']!r} has no data from {fed_by[0]}: {expr}"
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            for series in result:
                missing = legend - set(series["metric"])
                assert not missing, f"panel {panel['title']!r}: no {missing} for its legend in {series}"
    # The GPU panels show the sample's two GPUs as written, not a live GPU's readings.
    util = prometheus.answer('DCGM_FI_DEV_GPU_UTIL{job="dcgm-exporter"}')["result"]
    by_gpu = {series["metric"]["gpu"]: float(series["value"][1]) for series in util}
    assert by_gpu == {"0": 97, "1": 95}, f"the DCGM series are not those of the sample {DCGM_SAMPLE}: {util}"
    # The node memory panel shows this machine's: used is above 0 and below its total.
    (memory,) = prometheus.answer('node_memory_MemTotal_bytes{job="node-exporter"}')["result"]
    (used,) = prometheus.answer("node_memory_MemTotal_bytes - node_memory_MemAvailable_bytes")["result"]
    assert 0 < float(used["value"][1]) < float(memory["value"][1])


def ethernet_filter_keeps_this_machines_interfaces(prometheus: Prometheus, dashboard: dict[str, Any]) -> None:
    """The Ethernet panel's device filter keeps exactly this machine's interfaces that it does not
    name as loopback or container plumbing (lo, veth*, docker*, cni*, cali*, flannel*, the VPC CNI's
    per-pod eni*, ifb*), as the node exporter reports them: its data here is this machine's network,
    not an empty sum. Real nodes name theirs eth*, ens*, enp* (ENA on AWS), which the filter keeps; the
    interfaces are read from /proc/net/dev, which the node exporter reads too (same network namespace)."""
    (panel,) = [p for p in dashboard["panels"] if p.get("title") == "Node network (Ethernet)"]
    filters = {m for t in panel["targets"] for m in re.findall(r'device!~"([^"]*)"', t["expr"])}
    assert len(filters) == 1, f"the Ethernet panel's queries should share one device filter: {filters}"
    (excluded,) = filters
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]  # two header lines
    interfaces = {line.split(":", 1)[0].strip() for line in lines}
    kept = {name for name in interfaces if not re.fullmatch(excluded, name)}  # PromQL regexes are anchored
    assert kept, (
        f"this machine has no network interface besides those the Ethernet panel leaves out"
        f" ({sorted(interfaces)}), so that panel cannot have data here"
    )
    selector = f'node_network_receive_bytes_total{{job="node-exporter", device!~"{excluded}"}}'
    reported = {series["metric"]["device"] for series in prometheus.answer_with_data(selector)}
    assert reported == kept, f"the Ethernet panel keeps {sorted(reported)}; this machine has {sorted(kept)}"


def test_the_shipped_prometheus_config_is_valid() -> None:
    require(PROMTOOL)
    config = REPO / "deployments" / "observability" / "prometheus.yml"
    checked = subprocess.run(
        [str(PROMTOOL), "check", "config", str(config)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def shortened_rules(tmp_path: Path, alert: str, *, threshold_s: int, for_: str) -> Path:
    """A copy of the shipped rules in which only ``alert`` has a shorter threshold (the seconds its
    expression compares against) and ``for``; every other rule, and everything else, as shipped."""
    rules = yaml.safe_load(ALERTS.read_text())
    (rule,) = [r for group in rules["groups"] for r in group["rules"] if r.get("alert") == alert]
    rule["expr"], replaced = re.subn(r">\s*\d+", f"> {threshold_s}", rule["expr"])
    assert replaced == 1, f"{alert}: expected one '> <seconds>' threshold in {rule['expr']!r}"
    rule["for"] = for_
    copy = tmp_path / "alerts.yml"
    copy.write_text(yaml.safe_dump(rules))
    return copy


def test_a_stalled_trial_fires_the_shipped_no_progress_alert(
    tmp_path: Path, workspace: Path, prometheus_for: Callable[..., Prometheus]
) -> None:
    """A trial's job fails once and is restarted, reports once, then its loop stops advancing while
    its heartbeat keeps beating (as in a stuck collective); Prometheus, with the shipped rules loaded,
    fires TunepodTrialWithoutProgress for its study and counts the restart. The shipped rule waits
    40 min plus ``for: 5m``, so this Prometheus loads a copy of the shipped file in which only that
    rule's threshold (3 s) and ``for`` (1 s) are shortened."""
    study = "prom-stalled"
    tune = settings(
        workspace, study={"name": study}, num_trials=1, num_parallel=1, train={"entrypoint": str(STALL)}
    )
    tuner = make_tuner(workspace, tune)
    release = tuner.ctx.jobs_dir / "trial-0" / "release"
    rules = shortened_rules(tmp_path, "TunepodTrialWithoutProgress", threshold_s=3, for_="1s")
    endpoint = open_pipeline_metrics(MetricsSpec(port=0), pipeline=PIPELINE, run_id=tuner.ctx.parent_run_id)
    try:
        assert endpoint.server is not None
        prometheus = prometheus_for(f"127.0.0.1:{endpoint.server.server_port}", rules)
        assert prometheus.alert_names() == {
            "TunepodTrialWithoutProgress",
            "TunepodJobRestartLoop",
            "TunepodStudyWithoutCompletedTrial",
        }
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(tuner.run)
            try:
                firing = prometheus.wait_firing("TunepodTrialWithoutProgress", study, running)
            finally:
                release.parent.mkdir(parents=True, exist_ok=True)
                release.touch()  # the loop goes on and the trial completes
            trials = running.result(timeout=QUERY_TIMEOUT_S)

        assert firing["labels"]["step"] == "search" and firing["labels"]["severity"] == "warning"
        assert f"study {study} has not progressed" in firing["annotations"]["summary"]
        assert [t.outcome for t in trials.trials] == ["COMPLETE"]
        restarts = f'sum(tunepod_job_restarts_total{{study="{study}"}})'
        assert prometheus.query_until(restarts, {"": 1}) == {"": 1}
        # Nothing of the step runs any more: the gauge is gone, so the alert resolves.
        where = f'study="{study}"'
        assert prometheus.query_until(f"tunepod_job_last_progress_timestamp_seconds{{{where}}}", {}) == {}
    finally:
        endpoint.close()


def test_the_shipped_alert_rules_are_valid() -> None:
    require(PROMTOOL)
    checked = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 3 rules found" in checked.stdout


# promtool's rule unit tests: synthetic series on a virtual clock (minutes), evaluated every minute.
LABELS = 'pipeline="p", study="s", step="search", instance="orchestrator:9464", job="tunepod-pipeline"'
PROGRESS = f"tunepod_job_last_progress_timestamp_seconds{{{LABELS}}}"
RESTARTS = f"tunepod_job_restarts_total{{{LABELS}}}"
COMPLETED = f"tunepod_study_last_completed_timestamp_seconds{{{LABELS}}}"
RUNNING = f'tunepod_trials{{{LABELS}, state="RUNNING"}}'
# (input series and their values, [(minute, alert, fires)]), at the shipped thresholds.
RULE_CASES: dict[str, tuple[dict[str, str], list[tuple[int, str, bool]]]] = {
    # Last progress at time 0: past 40 min at minute 41, firing 5 min later.
    "stuck job": (
        {PROGRESS: "0x60"},
        [(45, "TunepodTrialWithoutProgress", False), (46, "TunepodTrialWithoutProgress", True)],
    ),
    "job advancing every minute": ({PROGRESS: "0+60x60"}, [(60, "TunepodTrialWithoutProgress", False)]),
    # The third restart at minute 4, firing a minute later.
    "three restarts in minutes": (
        {RESTARTS: "0 0 1 2 3x10"},
        [(4, "TunepodJobRestartLoop", False), (5, "TunepodJobRestartLoop", True)],
    ),
    "one restart every 40 minutes": (
        {RESTARTS: "0x39 1x39 2x39 3x39"},
        [(minute, "TunepodJobRestartLoop", False) for minute in (60, 100, 130, 155)],
    ),
    # Nothing completed since time 0 while a trial runs: past 2 h at minute 121, firing 5 min later.
    "study without completions": (
        {COMPLETED: "0x130", RUNNING: "1x130"},
        [(125, "TunepodStudyWithoutCompletedTrial", False), (126, "TunepodStudyWithoutCompletedTrial", True)],
    ),
    "study with nothing running": (
        {COMPLETED: "0x130", RUNNING: "0x130"},
        [(130, "TunepodStudyWithoutCompletedTrial", False)],
    ),
}


def test_the_shipped_alert_rules_fire_at_their_thresholds(tmp_path: Path) -> None:
    """``promtool test rules`` on the shipped rules as they are, except their annotations (promtool
    compares every annotation's full text; ``promtool check rules`` and the firing test above cover
    the templates)."""
    require(PROMTOOL)
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    labels = dict(item.split("=") for item in LABELS.replace('"', "").split(", "))
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": name, "values": values} for name, values in series.items()],
            "alert_rule_test": [
                {
                    "eval_time": f"{minute}m",
                    "alertname": alert,
                    "exp_alerts": [{"exp_labels": {**labels, "severity": "warning"}}] if fires else [],
                }
                for minute, alert, fires in checks
            ],
        }
        for series, checks in RULE_CASES.values()
    ]
    unit_tests = tmp_path / "alerts_test.yml"
    unit_tests.write_text(
        yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests})
    )
    tested = subprocess.run(
        [str(PROMTOOL), "test", "rules", str(unit_tests)], capture_output=True, text=True, check=False
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
