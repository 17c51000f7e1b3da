"""A real Prometheus scrapes a real tune: torchrun trials on the local launcher, the pipeline's /metrics
endpoint, and the tunepod_* series read back through Prometheus' HTTP API.

Needs Debian's prometheus (``scripts/prometheus-up``, which ``make test`` runs): without it these tests
skip with the reason, except under ``CI=true``, where a skip would hide a broken setup, so they fail.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from needs import skip_or_fail
from ports import free_port
from test_tuner import PIPELINE, make_tuner, settings

from tunepod.metrics import open_pipeline_metrics
from tunepod.spec.models import MetricsSpec

PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")
REPO = Path(__file__).resolve().parents[2]
STUDY = "prom-quad"
NUM_TRIALS = 3
EPOCHS = 2
# Bounds on waiting for Prometheus, never assertions about speed.
READY_TIMEOUT_S = 60.0
QUERY_TIMEOUT_S = 60.0


def require(tool: Path) -> None:
    if tool.exists():
        return
    reason = f"{tool} is missing: install Debian's prometheus with scripts/prometheus-up (make test runs it)"
    skip_or_fail(reason)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


class Prometheus:
    """A Prometheus server on a loopback port, scraping ``target`` every second; stopped on ``stop``."""

    def __init__(self, tmp_path: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "prometheus.log"
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: tunepod-pipeline\n    static_configs: [{{targets: ['{target}']}}]\n"
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
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited: {self.log_tail()}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        pytest.fail(f"prometheus was not ready after {READY_TIMEOUT_S} s: {self.log_tail()}")

    def query(self, promql: str) -> dict[str, float]:
        """The instant vector ``promql`` as {value of its single varying label (or ''): value}."""
        answer = get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert answer["status"] == "success", answer
        result = answer["data"]["result"]
        return {"".join(item["metric"].values()): float(item["value"][1]) for item in result}

    def query_until(self, promql: str, expected: dict[str, float]) -> dict[str, float]:
        """Poll ``promql`` (bounded) until it equals ``expected``; returns the last answer."""
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while (seen := self.query(promql)) != expected and time.monotonic() < deadline:
            time.sleep(0.5)
        return seen

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
def prometheus_for(tmp_path: Path) -> Iterator[Callable[[str], Prometheus]]:
    """Starts a Prometheus scraping the given target (once it answers ready); stops it afterwards."""
    require(PROMETHEUS)
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        server = Prometheus(tmp_path, target)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


def test_a_tune_is_scraped_and_its_metrics_read_back_through_prometheus(
    tmp_path: Path, prometheus_for: Callable[[str], Prometheus]
) -> None:
    tune = settings(
        tmp_path, study={"name": STUDY}, num_trials=NUM_TRIALS, train={"args": {"epochs": EPOCHS}}
    )
    tuner = make_tuner(tmp_path, tune)
    endpoint = open_pipeline_metrics(MetricsSpec(port=0), pipeline=PIPELINE, run_id=tuner.ctx.parent_run_id)
    try:
        assert endpoint.server is not None
        prometheus = prometheus_for(f"127.0.0.1:{endpoint.server.server_port}")
        trials = tuner.run()
        assert [t.outcome for t in trials.trials] == ["COMPLETE"] * NUM_TRIALS

        where = f'pipeline="{PIPELINE}", study="{STUDY}", step="search"'
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
    finally:
        endpoint.close()


def test_the_shipped_prometheus_config_is_valid() -> None:
    require(PROMTOOL)
    config = REPO / "deployments" / "observability" / "prometheus.yml"
    checked = subprocess.run(
        [str(PROMTOOL), "check", "config", str(config)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
