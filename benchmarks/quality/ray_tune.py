"""The baselines from Ray Tune: its ASHA and PBT schedulers, on the same trials as tunepod's arms.

The same spec (loaded with the same overrides, so the same search space, fixed parameters and trial
budget) drives a ``ray.tune.Tuner``: ``num_samples`` = the study's ``num_trials``,
``max_concurrent_trials`` = its ``num_parallel``, ``BasicVariantGenerator(random_state=seed)`` (random
search), and one scheduler over the reported ``step``:

* ``ray asha``: ``ASHAScheduler`` with ``grace_period`` = the tpe+asha arm's first rung
  (``Workload.asha_first_rung``), ``max_t`` = a full trial's last step, reduction factor 3. A trial
  it stops is killed: Ray's ASHA cannot pause.
* ``ray pbt``: ``PopulationBasedTraining`` as tunepod's pbt arm is set (workloads.Workload.pbt_options):
  a population of ``num_parallel`` trials as long as the pbt arm's members, ``perturbation_interval``
  = a full trial's length, quantile 0.25, ``lr`` explored (factors 0.8 and 1.2, resampled with p
  0.25). Every report hands Ray a copy of the checkpoint the script saved at that step; an exploited
  trial is restarted by Ray with the donor's copy, which the trial function puts in its checkpoint
  folder, so the script resumes there.

Each trial runs the training script as a subprocess with the training contract's variables set as
tunepod's local launcher sets them, so it writes the same ``metrics.jsonl`` (under
``<folder>/jobs/trial-N/``), which the trial function tails and hands to ``tune.report`` line by
line. When the scheduler stops a trial, ``tune.report`` raises ``SystemExit`` in the trial's thread
and the subprocess is killed.

Time to target is read from those files as for tunepod's arms; the study's start is the moment just
before ``Tuner.fit()`` (Ray itself is already up: ``ray.init`` is not counted, as tunepod's start-up
is not), written by the child into ``fit.json``.

    .venv/bin/python -m benchmarks.quality.ray_tune CONFIG_JSON     # the child; the benchmark runs it
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
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
from benchmarks.quality.workloads import (
    PBT,
    RANDOM,
    RAY_PBT,
    REDUCTION_FACTOR,
    REPO,
    TUNE_STEP,
    Workload,
)
from tunepod.runtime.metrics import Report

FIT_FILE = "fit.json"
STARTED_FILE = "started"
STOPPED_FILE = "stopped_by_ray"
SNAPSHOTS = "ray-checkpoints"
CHECKPOINT_WAIT_S = 30.0
TAIL_POLL_S = 0.1
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RayStudy:
    """What the child needs: the spec as the random arm loads it, and the scheduler's settings."""

    arm: str
    spec: str
    overrides: list[str]
    seed: int
    folder: str
    metric: str
    mode: str
    grace_period: int
    """Ray's ASHA's first rung, in steps: where tunepod's tpe+asha arm puts its first."""
    max_step: int
    perturb: dict[str, Any]
    """PBT's ``interval``, ``quantile``, ``params``, ``factors``, ``resample_probability``."""


def run_ray_study(
    workload: Workload,
    arm: str,
    seed: int,
    root: Path,
    *,
    stop_at_target: bool,
    abort: threading.Event | None = None,
) -> StudyRun:
    """One Ray Tune study in a child process, stopped at its target like tunepod's (see study.py)."""
    folder = root / workload.study_name(arm, seed)
    folder.mkdir(parents=True)
    # The same space, fixed parameters, trial count and parallelism as tunepod's random (or pbt) arm.
    twin = PBT if arm == RAY_PBT else RANDOM
    config = RayStudy(
        arm=arm,
        spec=str(workload.spec),
        overrides=workload.overrides(twin, seed, root),
        seed=seed,
        folder=str(folder),
        metric=workload.goal.metric,
        mode="max" if workload.goal.direction == "maximize" else "min",
        grace_period=workload.asha_first_rung,
        max_step=workload.last_step(arm),
        perturb=pbt_settings(workload),
    )
    argv = [sys.executable, "-m", "benchmarks.quality.ray_tune", json.dumps(asdict(config))]
    jobs = folder / "jobs"

    def reached() -> bool:
        return first_hit(trial_reports(jobs), workload.goal) is not None

    # Ray gives its node 60 s to come up by default, which a loaded 2-core machine can exceed. Its
    # workers run at niceness 15 by default, and the trials' processes inherit it: beside tunepod's
    # arms (niceness 0) on a busy machine Ray's trials would get the CPU last, so they get 0 too.
    env = {"RAY_raylet_start_wait_time_s": "300", "RAY_worker_niceness": "0", **os.environ}
    stopped = watch_child(argv, env, folder / "ray.log", reached, stop_at_target, abort)
    fit = json.loads((folder / FIT_FILE).read_text())
    reports = trial_reports(jobs)
    hit = first_hit(reports, workload.goal)
    if hit is None and (stopped or "end" not in fit):
        raise StudyFailed(f"{arm} seed {seed}: stopped without a hit; see {folder}")
    starts = [
        float((d / STARTED_FILE).read_text()) for d in jobs.glob("trial-*") if (d / STARTED_FILE).exists()
    ]
    return StudyRun(
        workload=workload.name,
        arm=arm,
        seed=seed,
        folder=jobs,
        start=fit["start"],
        hit=hit,
        end=None if stopped else fit["end"],
        trials_started=trials_started_by(starts, hit.time) if hit else len(starts),
        pruned=stopped_early(jobs, reports, workload.last_step(arm)),
        best=best_value(reports, workload.goal),
    )


def pbt_settings(workload: Workload) -> dict[str, Any]:
    """tunepod's pbt arm's schedule, as Ray's PBT takes it (the explore defaults of ``PerturbSpec``)."""
    from tunepod.spec.models import PerturbSpec

    schedule = json.loads(workload.pbt_options(PBT)["pbt"])
    defaults = PerturbSpec()
    return {
        "interval": schedule["interval"],
        "quantile": schedule["quantile"],
        "params": schedule["perturb"]["params"],
        "factors": list(defaults.factors),
        "resample_probability": defaults.resample_probability,
    }


def stopped_early(jobs: Path, reports: dict[int, list[Report]], max_step: int) -> int:
    """Trials the scheduler stopped before their last step (ASHA also stops every trial at ``max_t``)."""
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
    """One Ray trial: the training script as a subprocess, its reports passed on to ``tune.report``
    (with a copy of that step's checkpoint when the scheduler needs one). Restarted by PBT with a
    donor's checkpoint, it resumes in the same job dir from that checkpoint."""
    from ray import tune

    from tunepod import runtime
    from tunepod.runtime.metrics import ReportTail

    job = config["job"]
    params = {**job["train_args"], **{key: config[key] for key in job["space"]}}
    number = int(tune.get_context().get_trial_id().rsplit("_", 1)[-1])
    job_dir = Path(job["jobs_dir"]) / f"trial-{number}"
    job_dir.mkdir(parents=True, exist_ok=True)
    started = job_dir / STARTED_FILE
    if not started.exists():  # a PBT restart is the same trial, started earlier
        started.write_text(repr(time.time()))
    checkpoint_dir = job_dir / "checkpoints"
    donor = tune.get_checkpoint()
    if donor is not None:
        take_donor_checkpoint(donor, checkpoint_dir)
    metrics = job_dir / "metrics.jsonl"
    tail = ReportTail(metrics)
    tail.read_new()  # an earlier run of this trial passed those on
    env = {
        **os.environ,
        runtime.PARAMS_ENV: json.dumps(params, sort_keys=True),
        runtime.DATA_DIR_ENV: job["data_dir"],
        runtime.CHECKPOINT_DIR_ENV: str(checkpoint_dir),
        runtime.RESULT_FILE_ENV: str(job_dir / "result.json"),
        runtime.METRICS_FILE_ENV: str(metrics),
    }
    with open(job_dir / "stdout.log", "ab") as out:
        process = subprocess.Popen(
            [sys.executable, job["entrypoint"]],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    try:
        while True:
            finished = process.poll() is not None
            for report in tail.read_new():
                checkpoint = None
                if job["checkpoints"]:
                    checkpoint = step_snapshot(checkpoint_dir, report.step, process)
                result = {**report.metrics, "step": report.step, "units": report.step + 1}
                tune.report(result, checkpoint=checkpoint)
                if checkpoint is not None:  # Ray has its own copy now
                    shutil.rmtree(checkpoint.path, ignore_errors=True)
            if finished:
                break
            time.sleep(TAIL_POLL_S)
    except SystemExit:
        (job_dir / STOPPED_FILE).touch()  # the scheduler stopped the trial
        raise
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"trial {number} exited {process.returncode}; see {job_dir}/stdout.log")


def step_snapshot(checkpoint_dir: Path, step: int, process: subprocess.Popen[bytes]) -> Any:
    """A ``ray.tune.Checkpoint`` of a copy of step ``step``, which the script saves right after
    reporting it (None if it never does): the script prunes its old steps as it goes, so Ray is given
    a folder of its own."""
    from ray.tune import Checkpoint

    from tunepod.runtime.checkpoints import saved_checkpoints, verified_checkpoint

    def saved() -> bool:  # read from the metadata alone: cheap to poll, whatever the state's size
        return any(info.step == step for info in saved_checkpoints(checkpoint_dir))

    deadline = time.monotonic() + CHECKPOINT_WAIT_S
    while True:
        exited = process.poll() is not None  # before the look: a save just before the exit counts
        if saved():
            break
        if exited or time.monotonic() > deadline:
            return None
        time.sleep(TAIL_POLL_S)
    verified = verified_checkpoint(checkpoint_dir, step)  # hashed once, now that it is whole
    if verified is None or verified.step != step:
        return None
    holder = checkpoint_dir.parent / SNAPSHOTS / str(step)
    shutil.rmtree(holder, ignore_errors=True)
    shutil.copytree(verified.path, holder / verified.path.name)
    return Checkpoint.from_directory(str(holder))


def take_donor_checkpoint(donor: Any, checkpoint_dir: Path) -> None:
    """Replace the trial's own checkpoints with the donor's step that PBT restarted it from."""
    from tunepod.runtime.checkpoints import copy_newest_checkpoint

    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    with donor.as_directory() as folder:
        if copy_newest_checkpoint(Path(folder), checkpoint_dir) is None:
            raise RuntimeError(f"PBT's checkpoint {folder} holds no intact step")


def scheduler(config: RayStudy, space: dict[str, Any]) -> Any:
    from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining

    if config.arm == RAY_PBT:
        perturb = config.perturb
        return PopulationBasedTraining(
            time_attr="units",  # tunepod's PBT counts units (a step + 1), so both decide at the same reports
            perturbation_interval=perturb["interval"],
            quantile_fraction=perturb["quantile"],
            resample_probability=perturb["resample_probability"],
            perturbation_factors=tuple(perturb["factors"]),
            hyperparam_mutations=ray_space({name: space[name] for name in perturb["params"]}),
        )
    return ASHAScheduler(
        time_attr="step",
        max_t=config.max_step,
        grace_period=config.grace_period,
        reduction_factor=REDUCTION_FACTOR,
    )


def start_ray(num_cpus: int, attempts: int = 3) -> None:
    """``ray.init``, tried again when the node fails to come up: on a loaded machine its raylet can
    give up waiting for the metrics agent it starts (a fixed wait that no setting moves)."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            return
        except Exception:
            with contextlib.suppress(Exception):
                ray.shutdown()
            if attempt == attempts:
                raise
            print(f"ray.init failed (attempt {attempt} of {attempts}); trying again", flush=True)


def child(config: RayStudy) -> None:
    import ray
    from ray import tune
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
    start_ray(settings.num_parallel)
    job = {
        "train_args": settings.train.args,
        "space": sorted(settings.space),
        "jobs_dir": str(folder / "jobs"),
        "data_dir": str(data_dir),
        "entrypoint": settings.train.entrypoint,
        "checkpoints": config.arm == RAY_PBT,
    }
    tuner = tune.Tuner(
        run_trial,
        param_space={**ray_space(settings.space), "job": job},
        tune_config=tune.TuneConfig(
            metric=config.metric,
            mode=config.mode,
            num_samples=settings.num_trials,
            scheduler=scheduler(config, settings.space),
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
