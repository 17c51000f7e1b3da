"""The third arm: Ray Tune's ASHA scheduler over random search, on the same trials as tunepod's arms.

The same spec (loaded with the same overrides, so the same search space, fixed parameters and trial
budget) drives a ``ray.tune.Tuner``: ``num_samples`` = the study's ``num_trials``,
``max_concurrent_trials`` = its ``num_parallel``, ``BasicVariantGenerator(random_state=seed)`` (random
search) and ``ASHAScheduler`` over the reported ``step`` with ``grace_period`` = Hyperband's
``min_resource``, ``max_t`` = a full trial's last step, reduction factor 3. Each trial runs the
training script as a subprocess with the training contract's variables set as tunepod's local launcher
sets them, so it writes the same ``metrics.jsonl`` (under ``<folder>/jobs/trial-N/``), which the
trial function tails and hands to ``tune.report`` line by line. When ASHA stops a trial,
``tune.report`` raises ``SystemExit`` in the trial's thread and the subprocess is killed.

Time to target is read from those files as for tunepod's arms; the study's start is the moment just
before ``Tuner.fit()`` (Ray itself is already up: ``ray.init`` is not counted, as tunepod's start-up
is not), written by the child into ``fit.json``.

    .venv/bin/python -m benchmarks.quality.ray_asha CONFIG_JSON     # the child; the benchmark runs it
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.quality.study import StudyFailed, StudyRun, watch_child
from benchmarks.quality.timing import best_value, first_hit, trial_reports, trials_started_by
from benchmarks.quality.workloads import RANDOM, RAY_ASHA, REDUCTION_FACTOR, REPO, TUNE_STEP, Workload
from tunepod.runtime.metrics import Report

FIT_FILE = "fit.json"
STARTED_FILE = "started"
STOPPED_FILE = "stopped_by_asha"
TAIL_POLL_S = 0.1
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RayStudy:
    """What the child needs: the spec as the random arm loads it, and ASHA's settings."""

    spec: str
    overrides: list[str]
    seed: int
    folder: str
    metric: str
    mode: str
    min_resource: int
    max_step: int


def run_ray_study(
    workload: Workload, seed: int, root: Path, *, stop_at_target: bool, abort: threading.Event | None = None
) -> StudyRun:
    """One Ray Tune study in a child process, stopped at its target like tunepod's (see study.py)."""
    folder = root / workload.study_name(RAY_ASHA, seed)
    folder.mkdir(parents=True)
    config = RayStudy(
        spec=str(workload.spec),
        # The random arm's overrides: the same space, fixed parameters, trial count and parallelism.
        overrides=workload.overrides(RANDOM, seed, root),
        seed=seed,
        folder=str(folder),
        metric=workload.goal.metric,
        mode="max" if workload.goal.direction == "maximize" else "min",
        min_resource=workload.min_resource,
        max_step=workload.max_step,
    )
    argv = [sys.executable, "-m", "benchmarks.quality.ray_asha", json.dumps(asdict(config))]
    jobs = folder / "jobs"

    def reached() -> bool:
        return first_hit(trial_reports(jobs), workload.goal) is not None

    # Ray gives its node 60 s to come up by default, which a loaded 2-core machine can exceed.
    env = {"RAY_raylet_start_wait_time_s": "300", **os.environ}
    stopped = watch_child(argv, env, folder / "ray.log", reached, stop_at_target, abort)
    fit = json.loads((folder / FIT_FILE).read_text())
    reports = trial_reports(jobs)
    hit = first_hit(reports, workload.goal)
    if hit is None and (stopped or "end" not in fit):
        raise StudyFailed(f"{RAY_ASHA} seed {seed}: stopped without a hit; see {folder}")
    starts = [
        float((d / STARTED_FILE).read_text()) for d in jobs.glob("trial-*") if (d / STARTED_FILE).exists()
    ]
    return StudyRun(
        workload=workload.name,
        arm=RAY_ASHA,
        seed=seed,
        folder=jobs,
        start=fit["start"],
        hit=hit,
        end=None if stopped else fit["end"],
        trials_started=trials_started_by(starts, hit.time) if hit else len(starts),
        pruned=stopped_early(jobs, reports, workload.max_step),
        best=best_value(reports, workload.goal),
    )


def stopped_early(jobs: Path, reports: dict[int, list[Report]], max_step: int) -> int:
    """Trials ASHA stopped before their last step (it also stops every trial that reaches ``max_t``)."""
    return sum(
        (jobs / f"trial-{number}" / STOPPED_FILE).exists() and max(r.step for r in trial) < max_step
        for number, trial in reports.items()
        if trial
    )


# ---------------------------------------------------------------------------------------------- the child


def ray_space(space: dict[str, Any]) -> dict[str, Any]:
    """The spec's search space in Ray Tune's terms (the same distributions)."""
    from ray import tune

    from tunepod.spec.models import CategoricalParam, FloatParam, IntParam

    converted: dict[str, Any] = {}
    for name, param in space.items():
        if isinstance(param, FloatParam):
            if param.log:
                converted[name] = tune.loguniform(param.low, param.high)
            elif param.step:
                converted[name] = tune.quniform(param.low, param.high, param.step)
            else:
                converted[name] = tune.uniform(param.low, param.high)
        elif isinstance(param, IntParam):
            # Optuna's int bounds are inclusive; Ray's lograndint excludes its upper bound.
            log = tune.lograndint(param.low, param.high + 1)
            converted[name] = log if param.log else tune.qrandint(param.low, param.high, param.step)
        elif isinstance(param, CategoricalParam):
            converted[name] = tune.choice(param.choices)
    return converted


def die_with_parent() -> None:
    """In the trial's subprocess: SIGKILL when the thread that started it goes (Ray kills actors)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run_trial(config: dict[str, Any]) -> None:
    """One Ray trial: the training script as a subprocess, its reports passed on to ``tune.report``."""
    from ray import tune

    from tunepod import runtime
    from tunepod.runtime.metrics import read_reports

    job = config["job"]
    params = {**job["train_args"], **{key: config[key] for key in job["space"]}}
    number = int(tune.get_context().get_trial_id().rsplit("_", 1)[-1])
    job_dir = Path(job["jobs_dir"]) / f"trial-{number}"
    job_dir.mkdir(parents=True)
    (job_dir / STARTED_FILE).write_text(repr(time.time()))
    env = {
        **os.environ,
        runtime.PARAMS_ENV: json.dumps(params, sort_keys=True),
        runtime.DATA_DIR_ENV: job["data_dir"],
        runtime.CHECKPOINT_DIR_ENV: str(job_dir / "checkpoints"),
        runtime.RESULT_FILE_ENV: str(job_dir / "result.json"),
        runtime.METRICS_FILE_ENV: str(job_dir / "metrics.jsonl"),
    }
    with open(job_dir / "stdout.log", "wb") as out:
        process = subprocess.Popen(
            [sys.executable, job["entrypoint"]],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    passed = 0
    try:
        while True:
            finished = process.poll() is not None
            reports = read_reports(job_dir / "metrics.jsonl")
            for report in reports[passed:]:
                tune.report({**report.metrics, "step": report.step})
            passed = len(reports)
            if finished:
                break
            time.sleep(TAIL_POLL_S)
    except SystemExit:
        (job_dir / STOPPED_FILE).touch()  # ASHA stopped the trial
        raise
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"trial {number} exited {process.returncode}; see {job_dir}/stdout.log")


def child(config: RayStudy) -> None:
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from tunepod.spec.loader import load_spec
    from tunepod.spec.models import StageStep, TuneStep
    from tunepod.staging.builtin import materialize_builtin

    spec = load_spec(config.spec, config.overrides)
    tune_step = spec.steps[TUNE_STEP]
    assert isinstance(tune_step, TuneStep)
    settings = tune_step.with_
    stage = next(step for step in spec.steps.values() if isinstance(step, StageStep))
    folder = Path(config.folder)
    data_dir = materialize_builtin(stage.with_.source, folder / "data")
    ray.init(num_cpus=settings.num_parallel, include_dashboard=False, log_to_driver=False)
    job = {
        "train_args": settings.train.args,
        "space": sorted(settings.space),
        "jobs_dir": str(folder / "jobs"),
        "data_dir": str(data_dir),
        "entrypoint": settings.train.entrypoint,
    }
    scheduler = ASHAScheduler(
        time_attr="step",
        max_t=config.max_step,
        grace_period=config.min_resource,
        reduction_factor=REDUCTION_FACTOR,
    )
    tuner = tune.Tuner(
        run_trial,
        param_space={**ray_space(settings.space), "job": job},
        tune_config=tune.TuneConfig(
            metric=config.metric,
            mode=config.mode,
            num_samples=settings.num_trials,
            scheduler=scheduler,
            search_alg=BasicVariantGenerator(random_state=config.seed, max_concurrent=settings.num_parallel),
        ),
        run_config=tune.RunConfig(storage_path=str(folder / "ray_results"), verbose=0),
    )
    fit = {"start": time.time()}
    (folder / FIT_FILE).write_text(json.dumps(fit))
    results = tuner.fit()
    fit["end"] = time.time()
    if results.errors:
        raise SystemExit(f"{len(results.errors)} trials failed, the first: {results.errors[0]}")
    (folder / FIT_FILE).write_text(json.dumps(fit))
    with contextlib.suppress(Exception):
        ray.shutdown()


if __name__ == "__main__":
    child(RayStudy(**json.loads(sys.argv[1])))
