"""One launcher's soak: start the servers and ``tunepod run``, inject faults until the time is up, let
the study finish (bounded), check what it left, and clean up whatever a violation left running. Every
node it took out is back in service before it returns, whatever happened (``return_nodes``)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from benchmarks.chaos import nodes
from benchmarks.chaos.checks import Check, Verdict, leftovers, slurm_jobs_under, trial_effects, verdict
from benchmarks.chaos.faults import FaultDriver, Injection, NodeOutage
from benchmarks.chaos.study import (
    MARKER_ENV,
    MLFLOW_CLIENT_ENV,
    ChaosStudy,
    MlflowServer,
    Orchestrator,
    carrying,
    mlflow_server,
)

_LOOP_S = 0.2
#: Bound on the wait for the nodes the soak took out to be back in service at its end.
NODE_RETURN_LIMIT_S = 90.0


@dataclass(frozen=True)
class SoakConfig:
    launcher: str
    folder: Path
    seed: int
    inject_s: float
    """Faults are injected this long from the first trial's start, then the study finishes in peace."""
    drain_s: float
    """Bound on the time the study may take after ``inject_s`` before the soak gives up on it."""
    startup_s: float
    """Bound on the time from the start to the first trial (Prefect, MLflow, staging)."""
    num_trials: int
    num_parallel: int
    epochs: int
    sleep_s: float
    gap_s: float
    max_restarts: int
    prefect_api: str | None
    overlap: bool = False
    """Let orchestrator kills and MLflow outages overlap (``FaultDriver.overlap``)."""
    outage_s: tuple[float, float] = (3.0, 10.0)
    """Bounds of an MLflow outage's drawn length."""
    num_nodes: int = 1
    """Nodes per trial of the Slurm study; above 1 they are namespaced nodes, and nodes are lost."""
    node_outage_s: tuple[float, float] = (20.0, 40.0)
    """Bounds of a lost node's drawn time out (a killed one also waits to be marked DOWN)."""


@dataclass(frozen=True)
class SoakReport:
    config: SoakConfig
    study: ChaosStudy
    injected: list[Injection]
    verdict: Verdict
    leftover: Check
    wall_s: float
    orchestrator_starts: int
    mlflow_starts: int
    effects: dict[int, str]
    """What happened to each trial's job (``trial_effects``)."""
    outages: list[NodeOutage]
    """Every node the soak took out, when, and when it came back."""

    @property
    def held(self) -> bool:
        return self.verdict.held and self.leftover.held


def run_soak(config: SoakConfig) -> SoakReport:
    marker = f"{config.launcher}-{uuid.uuid4().hex[:12]}"
    env = soak_env(config, marker)
    started = time.monotonic()
    with mlflow_server(config.folder / "mlflow", env) as server:
        study = ChaosStudy(
            config.folder / "study", config.launcher, server.url, config.num_trials,
            config.num_parallel, config.epochs, config.sleep_s, config.max_restarts, config.num_nodes,
        ).write()  # fmt: skip
        orchestrator = Orchestrator(study, env)
        rng = random.Random(f"{config.seed}/{config.launcher}")
        driver = FaultDriver(
            study, orchestrator, server, rng, config.gap_s, num_nodes=config.num_nodes,
            overlap=config.overlap, outage_s=config.outage_s, node_outage_s=config.node_outage_s,
        )  # fmt: skip
        try:
            orchestrator.start()
            unfinished = drive(config, orchestrator, driver, started)
        finally:
            returned = return_nodes(driver)
        bring_back(server, driver)
        found = verdict(study, server.url, orchestrator.exit_codes, driver.injected)
        found.add("study finished within the bound", {None: [unfinished] if unfinished else []})
        if config.num_nodes > 1:
            found.checks.append(returned)
    left = leftovers(marker, study)
    clean_up(marker, study)
    return SoakReport(
        config, study, driver.injected, found, left, time.monotonic() - started,
        orchestrator.starts, server.starts, trial_effects(study), driver.outages,
    )  # fmt: skip


def soak_env(config: SoakConfig, marker: str) -> dict[str, str]:
    env = {**os.environ, **MLFLOW_CLIENT_ENV, MARKER_ENV: marker, "COLUMNS": "200"}
    env |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_COLORS": "false"}
    # Heartbeats every 2 s: a rank's pid is known soon after it starts, so it can be the target.
    env["TUNEPOD_HEARTBEAT_S"] = "2"
    if config.prefect_api:
        env["PREFECT_API_URL"] = config.prefect_api
    else:  # Prefect's temporary server, in a home of the soak's own (never another run's database)
        env.pop("PREFECT_API_URL", None)
        env["PREFECT_HOME"] = str(config.folder / "prefect")
        env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    return env


def drive(config: SoakConfig, orchestrator: Orchestrator, driver: FaultDriver, started: float) -> str:
    """Inject faults for ``inject_s`` from the first trial's start, then wait for the orchestrator to
    exit. Returns why the study did not finish ('' when it did); a run past the bound is killed."""
    inject_until: float | None = None
    while orchestrator.exited() is None:
        now = time.monotonic()
        if inject_until is None and driver.study.job_dirs():
            inject_until = now + config.inject_s
            driver.begin()
        if inject_until is not None and now < inject_until:
            driver.step()
        driver.tend()
        give_up_at = (inject_until or started + config.startup_s) + config.drain_s
        if now > give_up_at:
            orchestrator.kill()
            return f"tunepod run still ran {now - started:.0f} s after the start: killed"
        time.sleep(_LOOP_S)
    orchestrator.finish()
    return ""


def bring_back(server: MlflowServer, driver: FaultDriver) -> None:
    """The MLflow server up again (an outage may still run when the study ends) for the checks."""
    if driver.mlflow_down():
        server.start()
    server.wait_ready()


def return_nodes(driver: FaultDriver) -> Check:
    """Bring back every node the soak took out and wait (bounded) until each serves jobs again; one
    still down or drained after half the bound is resumed by the controller. The check names them."""
    outages = driver.bring_nodes_back()
    taken = sorted({outage.node for outage in outages})
    deadline = time.monotonic() + NODE_RETURN_LIMIT_S
    resumed = False
    while True:
        listed = nodes.node_states()
        states = {node: listed.get(node, "unknown") for node in taken}
        out = {node: state for node, state in states.items() if not nodes.in_service(state)}
        if not out or time.monotonic() > deadline:
            break
        if not resumed and time.monotonic() > deadline - NODE_RETURN_LIMIT_S / 2:
            resumed = True
            for node, state in out.items():
                if state.startswith(("down", "drain")):
                    nodes.resume(node)
        time.sleep(1.0)
    problems = [f"node {node} is {state} at the end" for node, state in out.items()]
    problems += [f"node {o.node}: {o.problem}" for o in outages if o.back_at_s is None and o.problem]
    detail = "; ".join(
        f"{o.node} {o.kind.value} at {o.out_at_s:.0f} s, back at {o.back_at_s:.0f} s"
        if o.back_at_s is not None else f"{o.node} {o.kind.value} at {o.out_at_s:.0f} s, not back"
        for o in outages
    )  # fmt: skip
    return Check("nodes taken out are back in service", problems, detail or "no node taken out")


def clean_up(marker: str, study: ChaosStudy) -> None:
    """Stop whatever a violation left running, so that the machine is as before the soak."""
    for line in slurm_jobs_under(study.root):
        subprocess.run(["scancel", line.split()[0]], capture_output=True, timeout=30, check=False)
    for pid in carrying(MARKER_ENV, marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def describe(config: SoakConfig) -> Mapping[str, object]:
    """The settings a table of results should name."""
    return {
        "trials": config.num_trials,
        "parallel": config.num_parallel,
        "epochs": config.epochs,
        "sleep_s": config.sleep_s,
        "gap_s": config.gap_s,
        "max_restarts": config.max_restarts,
        "outage_s": config.outage_s,
        "nodes": config.num_nodes,
    }
