"""Both UIs in a real browser, after a signed webhook ran the digits pipeline through the real stack.

One stack for the module (`python -m tunepod.stack up`, free ports, state under tmp): its receiver has a
test hook `ui` whose overrides give the digits spec a tiny budget and keep every store under tmp (MLflow
in the very `mlflow.db` the stack's MLflow server serves), and its Prefect server has a copy of the
`digits` deployment of deployments/prefect.yaml whose trigger expects `tunepod.webhook.ui`. The tests run
in file order: a signed POST to the receiver starts the deployment and its flow run completes; then
Debian's Chromium, driven by Playwright, checks what the Prefect UI and the MLflow UI show of it. Every
page asserted on is saved as a PNG in `.tunepod/screenshots/` (git-ignored) for a human to look at.

Needs `/usr/bin/chromium` (`sudo scripts/browser-up`) and the `playwright` Python package (its own
driver; no downloaded browser): without them the module skips, and fails when CI=true.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml
from needs import skip_or_fail
from ports import free_port

from tunepod.stack.processes import ServiceRecord, group_members, is_alive
from tunepod.webhook.signatures import standard_headers

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / ".tunepod" / "screenshots"
CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps dialling Google, which this closed network refuses.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOOK = "ui"
DEPLOYMENT = "digits-ui"
SECRET_ENV = "TUNEPOD_HOOK_UI_SECRET"
NUM_TRIALS = 2
FLOW_RUN_LIMIT_S = 300.0
UI_WAIT_MS = 30_000
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def browser_missing() -> str | None:
    """Why this machine cannot drive Chromium (None when it can)."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (pip install -e '.[dev]'; never `playwright install`)"
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is missing: run sudo scripts/browser-up"
    return None


@pytest.fixture(scope="module", autouse=True)
def chromium_available() -> None:
    # Autouse, so it runs before the (expensive) stack starts.
    reason = browser_missing()
    if reason is None:
        return
    skip_or_fail(f"no browser for the UI tests: {reason}")


pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------------------ the stack


@dataclass(frozen=True)
class Stack:
    home: Path
    env: dict[str, str]
    prefect_url: str
    mlflow_url: str
    webhook_url: str

    @property
    def api(self) -> str:
        return f"{self.prefect_url}/api"

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tunepod.stack", *args],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    def records(self) -> list[ServiceRecord]:
        found = [ServiceRecord.read(p) for p in sorted((self.home / "stack").glob("*.json"))]
        return [record for record in found if record is not None]


def write_webhook_config(path: Path, home: Path, tmp: Path) -> None:
    """The hook `ui`: the digits spec on a tiny budget, every store under tmp (MLflow: the server's db)."""
    overrides = [
        "steps.search.with.num_trials={payload.num_trials}",
        "steps.search.with.train.args.epochs=2",
        # One process a trial (started without torchrun): this test is about the UIs, DDP runs elsewhere.
        "steps.search.with.train.resources.procs_per_node=1",
        "steps.check.with.top_k=1",
        f"tracking.uri=sqlite:///{home}/mlflow.db",
        f"launcher.root={tmp}/shared",
        f"steps.search.with.study.storage=journal://{tmp}/optuna.log",
    ]
    hook = {"spec": "examples/digits/pipeline.yaml", "secrets": [{"env": SECRET_ENV}], "overrides": overrides}
    path.write_text(yaml.safe_dump({"hooks": {HOOK: hook}}, sort_keys=False))


def write_prefect_file(path: Path) -> None:
    """deployments/prefect.yaml's `digits` deployment, renamed, triggered by `tunepod.webhook.ui` only."""
    project = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    [digits] = [d for d in project["deployments"] if d["name"] == "digits"]
    digits["name"] = DEPLOYMENT
    [trigger] = digits["triggers"]
    trigger["expect"] = [f"tunepod.webhook.{HOOK}"]
    project["deployments"] = [digits]
    project.pop("definitions", None)  # anchors already resolved by the load
    path.write_text(yaml.safe_dump(project, sort_keys=False))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("ui")
    home = tmp / "tunepod"
    webhook_config, prefect_file = tmp / "webhooks.yaml", tmp / "prefect.yaml"
    write_webhook_config(webhook_config, home, tmp)
    write_prefect_file(prefect_file)
    ports = {name: free_port() for name in ("PREFECT", "MLFLOW", "WEBHOOK")}
    # The hook's secret variable is not exported: `up` generates the secret into the stack's home.
    env = {
        **{name: value for name, value in os.environ.items() if name != SECRET_ENV},
        "TUNEPOD_HOME": str(home),
        "COLUMNS": "250",
        **{f"TUNEPOD_{name}_PORT": str(port) for name, port in ports.items()},
    }
    host = "http://127.0.0.1"
    stack = Stack(
        home, env, f"{host}:{ports['PREFECT']}", f"{host}:{ports['MLFLOW']}", f"{host}:{ports['WEBHOOK']}"
    )
    try:
        started = stack.cli("up", "--webhook-config", str(webhook_config))
        assert started.returncode == 0, started.stdout + started.stderr
        assert f"generated secrets for {SECRET_ENV} in {home / 'secrets'}/" in started.stdout
        assert {r.name for r in stack.records()} == {
            "prefect-server",
            "prefect-worker",
            "mlflow-server",
            "webhook",
        }
        deployed = stack.cli("deploy", "--prefect-file", str(prefect_file))
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield stack
    finally:
        records = stack.records()
        stopped = stack.cli("down")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        left = {r.name: group_members(r.pid) for r in records if is_alive(r) or group_members(r.pid)}
        assert not left, f"processes left after down: {left}"


@dataclass(frozen=True)
class Triggered:
    response: httpx.Response
    deployment: dict[str, Any]
    flow_run: dict[str, Any]


@pytest.fixture(scope="module")
def triggered(stack: Stack) -> Triggered:
    """A signed delivery to the hook, and the flow run it started, once final."""
    body = json.dumps({"num_trials": NUM_TRIALS}).encode()
    secret_file = stack.home / "secrets" / SECRET_ENV  # generated by `up`: the variable was not exported
    assert secret_file.stat().st_mode & 0o777 == 0o600
    headers = {
        **standard_headers([secret_file.read_text().strip()], body),
        "content-type": "application/json",
    }
    response = httpx.post(f"{stack.webhook_url}/hooks/{HOOK}", content=body, headers=headers, timeout=30.0)
    deployment = api_get(stack, f"/deployments/name/tunepod-pipeline/{DEPLOYMENT}")
    flow_run = wait_for_flow_run(stack, deployment["id"]) if response.status_code == 202 else {}
    return Triggered(response, deployment, flow_run)


def test_a_signed_webhook_runs_the_deployment_to_completion(stack: Stack, triggered: Triggered) -> None:
    assert triggered.response.status_code == 202, triggered.response.text
    accepted = triggered.response.json()
    assert accepted["event_id"] and accepted["hook"] == HOOK
    assert f"steps.search.with.num_trials={NUM_TRIALS}" in accepted["overrides"]
    assert triggered.flow_run["state_type"] == "COMPLETED", triggered.flow_run["state"]
    assert triggered.flow_run["parameters"]["overrides"] == accepted["overrides"]
    # An unsigned delivery is refused before anything is published.
    unsigned = httpx.post(
        f"{stack.webhook_url}/hooks/{HOOK}", content=b"{}", headers={"content-type": "application/json"}
    )
    assert unsigned.status_code == 401, unsigned.text


# ------------------------------------------------------------------------------------ the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import expect, sync_playwright

    # Every wait below is bounded by this: a page that never shows the text fails the test.
    expect.set_options(timeout=UI_WAIT_MS)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    # UTC: the schedule is rendered in the browser's time zone.
    context = browser.new_context(viewport={"width": 1920, "height": 1080}, timezone_id="UTC", locale="en-US")
    context.set_default_timeout(UI_WAIT_MS)
    try:
        yield context.new_page()
    finally:
        context.close()


def open_page(page: Page, url: str) -> None:
    # Not "networkidle": MLflow's UI keeps polling and never gets there; each test waits for its text.
    page.goto(url, wait_until="load")


def screenshot(page: Page, name: str) -> Path:
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def test_prefect_ui_lists_the_deployment_with_its_inactive_schedule(
    stack: Stack, triggered: Triggered, page: Page
) -> None:
    from playwright.sync_api import expect

    open_page(page, f"{stack.prefect_url}/deployments")
    row = page.get_by_role("row").filter(has_text=DEPLOYMENT)
    expect(row).to_contain_text("tunepod-pipeline")
    expect(row).to_contain_text("At 03:00 AM every day")
    screenshot(page, "prefect-deployments")

    open_page(page, f"{stack.prefect_url}/deployments/deployment/{triggered.deployment['id']}")
    expect(page.get_by_text("At 03:00 AM every day")).to_be_visible()
    expect(page.get_by_role("switch")).to_have_attribute("aria-checked", "false")
    expect(page.get_by_text(f"{DEPLOYMENT}__automation_1")).to_be_visible()
    screenshot(page, "prefect-deployment")


def test_prefect_ui_shows_the_triggered_flow_run_completed(
    stack: Stack, triggered: Triggered, page: Page
) -> None:
    from playwright.sync_api import expect

    open_page(page, f"{stack.prefect_url}/runs/flow-run/{triggered.flow_run['id']}")
    expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
    expect(page.get_by_role("link", name=DEPLOYMENT).first).to_be_visible()
    expect(page.get_by_text(f"{DEPLOYMENT}__automation_1")).to_be_visible()
    screenshot(page, "prefect-flow-run")


def test_prefect_ui_shows_the_tune_steps_progress_and_trial_table(
    stack: Stack, triggered: Triggered, page: Page
) -> None:
    """The live view a tune step keeps while it runs (its last state, once the run is over; the
    values are checked through the API in tests/integration/test_prefect_tasks.py)."""
    from playwright.sync_api import expect

    for key, description in [
        ("search-progress", "Finished trials of step search"),
        ("search-trials", "Trials of step search, so far"),
    ]:
        open_page(page, f"{stack.prefect_url}/artifacts/key/{key}")
        expect(page.get_by_text(description).first).to_be_visible()
        # On the tune step's task run, of the triggered flow run.
        expect(page.get_by_role("link", name="search", exact=True).first).to_be_visible()
        screenshot(page, f"prefect-{key}")


# ------------------------------------------------------------------------------------ MLflow


@dataclass(frozen=True)
class Tracked:
    experiment_id: str
    parent: Any
    trials: list[Any]


@pytest.fixture(scope="module")
def tracked(stack: Stack, triggered: Triggered) -> Tracked:
    """What the stack's MLflow server holds of the triggered run (through its REST API)."""
    from mlflow import MlflowClient

    client = MlflowClient(stack.mlflow_url)
    experiment = client.get_experiment_by_name("digits")
    assert experiment is not None
    flow_run_id = triggered.flow_run["id"]
    [parent] = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    trials = client.search_runs(
        [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    trials = sorted(
        (t for t in trials if t.info.run_name.startswith("trial-")), key=lambda t: t.info.run_name
    )
    assert len(trials) == NUM_TRIALS, [t.info.run_name for t in trials]
    return Tracked(experiment.experiment_id, parent, trials)


def test_mlflow_ui_lists_the_pipeline_run_and_its_trials(stack: Stack, tracked: Tracked, page: Page) -> None:
    from playwright.sync_api import expect

    open_page(page, f"{stack.mlflow_url}/#/experiments/{tracked.experiment_id}/runs")
    parent_link = page.get_by_role("link", name=tracked.parent.info.run_name, exact=True)
    expect(parent_link).to_be_visible()
    for trial in tracked.trials:
        expect(page.get_by_role("link", name=trial.info.run_name, exact=True)).to_have_count(0)
    # The parent's row is collapsed: the only button of its run-name cell expands it.
    name_cell = parent_link.locator("xpath=ancestor::div[@role='gridcell'][1]")
    name_cell.get_by_role("button").click()
    for trial in tracked.trials:
        expect(page.get_by_role("link", name=trial.info.run_name, exact=True)).to_be_visible()
    screenshot(page, "mlflow-experiment-runs")


def test_mlflow_ui_shows_the_parent_run_with_its_child_runs(
    stack: Stack, tracked: Tracked, page: Page
) -> None:
    from playwright.sync_api import expect

    parent = tracked.parent.info
    open_page(page, f"{stack.mlflow_url}/#/experiments/{tracked.experiment_id}/runs/{parent.run_id}")
    expect(page.get_by_text("Child runs", exact=True)).to_be_visible()
    for trial in tracked.trials:
        expect(page.get_by_role("link", name=trial.info.run_name)).to_be_visible()
    expect(page.get_by_text("check.best_test_accuracy", exact=True)).to_be_visible()
    screenshot(page, "mlflow-parent-run")


def test_mlflow_ui_shows_each_trials_val_accuracy(stack: Stack, tracked: Tracked, page: Page) -> None:
    from playwright.sync_api import expect

    parent = tracked.parent.info
    for trial in tracked.trials:
        open_page(page, f"{stack.mlflow_url}/#/experiments/{tracked.experiment_id}/runs/{parent.run_id}")
        page.get_by_role("link", name=trial.info.run_name).click()
        expect(page).to_have_url(
            f"{stack.mlflow_url}/#/experiments/{tracked.experiment_id}/runs/{trial.info.run_id}"
        )
        metrics = page.get_by_role("row").filter(has_text="val_accuracy")
        expect(metrics.first).to_contain_text(str(trial.data.metrics["val_accuracy"]))
        screenshot(page, f"mlflow-{trial.info.run_name}")


def test_mlflow_ui_lists_the_registered_model_with_its_champion_alias(stack: Stack, page: Page) -> None:
    from playwright.sync_api import expect

    # MLflow advertises its new registry UI in a modal that blocks clicks; close it whenever it shows.
    promo = page.get_by_role("dialog").filter(has_text="new Model Registry UI")
    page.add_locator_handler(promo, lambda dialog: dialog.get_by_role("button", name="Close").click())
    open_page(page, f"{stack.mlflow_url}/#/models")
    row = page.get_by_role("row").filter(has_text="digits-mlp")
    expect(row).to_contain_text("@ champion")
    expect(promo).to_be_hidden()  # not mid-fade in the screenshot
    screenshot(page, "mlflow-models")

    row.get_by_role("link", name="digits-mlp").click()
    version = page.get_by_role("row").filter(has_text="Version 1")
    expect(version).to_contain_text("champion")
    screenshot(page, "mlflow-model-digits-mlp")


# ------------------------------------------------------------------------------------ helpers


def api_get(stack: Stack, path: str) -> Any:
    response = httpx.get(f"{stack.api}{path}", timeout=10.0)
    assert response.is_success, f"GET {path}: {response.status_code} {response.text}"
    return response.json()


def wait_for_flow_run(stack: Stack, deployment_id: str) -> dict[str, Any]:
    """The deployment's one flow run once it is final; fails with the worker's log after the limit."""
    query = {"deployments": {"id": {"any_": [deployment_id]}}}
    deadline = time.monotonic() + FLOW_RUN_LIMIT_S
    while time.monotonic() < deadline:
        runs = httpx.post(f"{stack.api}/flow_runs/filter", json=query, timeout=10.0).json()
        if runs and runs[0]["state_type"] in FINAL_STATES:
            assert len(runs) == 1, runs
            return dict(runs[0])
        time.sleep(1.0)
    worker_log = (stack.home / "logs" / "prefect-worker.log").read_text()[-4000:]
    pytest.fail(f"no final flow run of {DEPLOYMENT} after {FLOW_RUN_LIMIT_S}s:\n{worker_log}")
