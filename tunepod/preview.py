"""``tunepod render``: what the launcher would send for a tune step's first trial, sent nowhere.

A platform team reviews this before a first run, as with ``kubectl --dry-run`` or ``hyp create
--dry-run``: the batch script (Slurm), the HyperPodPyTorchJob or PyTorchJob manifest (HyperPod EKS),
the CreateTrainingJob request (SageMaker) or the command line and environment (local). It is the
launcher's own ``render`` of the job the tuner builds (``trial_job_spec``), so it is what a run sends
for that trial, but for three things a run only knows then: the submission id (new for each attempt;
one is drawn here), the trial's MLflow run id (``RUN_ID_PLACEHOLDER``), and the parameters, which are
what the step's sampler gives the first trial of a new study (its ``enqueue`` configurations first;
a seeded sampler gives the same values in the run; a study that already has trials, or a
``warm_start``, gives others).

Nothing is written, submitted or opened: no study storage, no MLflow server, no cluster, no AWS
client. Every store URI the spec names is shown redacted, and so is every secret a URL in the payload
carries; every variable of the job's environment named as a credential (``tunepod.stores.is_secret_name``:
``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN`` ...) is rendered with ``***`` for its value.

What a run would refuse to send (a path the platform would not see, no instance type) does not stop
the preview: the launcher renders what it can (``tunepod.launch.refusals``), and the preview lists every
problem after the payload, as ``kubectl apply --dry-run=server`` does.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.storages import InMemoryStorage

from tunepod.errors import TunepodError
from tunepod.hpo.study import distributions, make_sampler, reseed_for_next_trial
from tunepod.hpo.tuner import trial_job_spec
from tunepod.launch.base import SUBMISSION_ID_ENV, JobSpec, Launcher, Rendered
from tunepod.launch.factory import make_launcher
from tunepod.launch.paths import SharedRoot
from tunepod.launch.refusals import collecting
from tunepod.launch.submission import new_submission_id
from tunepod.spec.models import AUTO, LauncherSpec, PipelineSpec, StageStep, TuneSettings, TuneStep
from tunepod.spec.parallelism import job_layout
from tunepod.steps.stage import staged_path
from tunepod.stores import HIDDEN, is_secret_name, redacted, secret_values, shown_env

RUN_ID_PLACEHOLDER = "<mlflow-run-id>"
"""Stands for the trial's MLflow run id, which exists only once a run has created it."""


@dataclass(frozen=True)
class TrialPreview:
    """One tune step's first trial: its job, the launcher's rendering of its first attempt (what a run
    sends), that rendering with the job's credentials hidden (what is shown), and what a run would
    refuse it for."""

    step: str
    study: str
    number: int
    launcher: str
    job: JobSpec
    rendered: Rendered
    shown: Rendered
    problems: tuple[str, ...] = ()

    def text(self, *secrets: str, values: Iterable[str] = ()) -> str:
        """The payload in its native form, as shown: credentials of the environment, ``secrets``
        (store URIs), the secret ``values`` (``PipelineSpec.secret_values``) and every URL's password
        as ``***``."""
        header = (
            f"# step {self.step}: trial {self.number} of study {self.study}, launcher {self.launcher}, "
            f"job dir {self.job.job_dir}\n# ({SUBMISSION_ID_ENV} differs in each attempt; "
            f"{RUN_ID_PLACEHOLDER} is the trial's MLflow run)\n"
        )
        native = _native(self.launcher, self.shown.payload, _shown_job(self.job))
        job_secrets = secret_values({"env": dict(self.job.env)})
        return redacted(header + native, *secrets, values=[*values, *job_secrets])


def preview_trials(spec: PipelineSpec, launcher: Launcher, *, step: str | None = None) -> list[TrialPreview]:
    """The first trial of each tune step (of ``step`` only, when given), rendered by ``launcher``, with
    what a run would refuse it for in its ``problems``.

    Raises ``TunepodError`` for a ``step`` that is not a tune step of the spec, and for a job the
    launcher cannot render at all (a layout that does not fit, a value a batch script cannot hold)."""
    tune_steps = [name for name, body in spec.steps.items() if isinstance(body, TuneStep)]
    if step is not None and step not in tune_steps:
        raise TunepodError(
            f"--step {step!r} is not a tune step of pipeline {spec.name}; fix: name one of "
            f"{', '.join(tune_steps) or '(none: the spec has no tune step)'}"
        )
    shared = SharedRoot(Path(spec.launcher.root))
    shown_launcher = _shown_launcher(spec.launcher, launcher)
    return [
        _first_trial(spec, name, shared, launcher, shown_launcher)
        for name in tune_steps
        if step in (None, name)
    ]


def _first_trial(
    spec: PipelineSpec, name: str, shared: SharedRoot, launcher: Launcher, shown_launcher: Launcher
) -> TrialPreview:
    body = spec.steps[name]
    assert isinstance(body, TuneStep)
    settings = body.with_
    number, sampled = _first_params(settings)
    params = {**settings.train.args, **sampled}
    try:
        layout = job_layout(settings.train.parallelism, settings.train.resources, params)
    except ValueError as exc:
        raise TunepodError(
            f"step {name}: the first trial's sampled layout does not fit its resources ({exc}); a run "
            "prunes such a trial without a job, so there is nothing to render for it"
        ) from exc
    job_dir = shared.jobs_dir(settings.study.name) / f"trial-{number}"
    job = trial_job_spec(
        settings,
        number,
        job_dir,
        params,
        data_dir=str(_dataset(spec, name, shared)),
        tracking_uri=spec.tracking.uri,
        run_id=RUN_ID_PLACEHOLDER,
        layout=layout,
    )
    job = job.with_env({SUBMISSION_ID_ENV: new_submission_id()})
    with collecting() as problems:
        rendered = launcher.render(job, attempt=1)
    shown_job = _shown_job(job)
    if shown_launcher is launcher and shown_job == job:
        shown = rendered
    else:
        with collecting():  # the same problems, found above
            shown = shown_launcher.render(shown_job, attempt=1)
    return TrialPreview(
        name, settings.study.name, number, launcher.kind, job, rendered, shown, tuple(problems)
    )


def _shown_job(job: JobSpec) -> JobSpec:
    """``job`` with each credential of its environment (``is_secret_name``) as ``***``: rendering it
    shows none."""
    hidden = {name: HIDDEN for name in job.env if is_secret_name(name)}
    return job.with_env(hidden) if hidden else job


def _shown_launcher(spec: LauncherSpec, launcher: Launcher) -> Launcher:
    """A launcher like ``launcher`` whose own ``env`` (the spec's, added to every job) is as shown;
    ``launcher`` itself when that env holds no credential."""
    env: dict[str, str] = getattr(spec, "env", {})
    if not any(is_secret_name(name) for name in env):
        return launcher
    return make_launcher(spec.model_copy(update={"env": shown_env(env)}), connect=False)


def _first_params(settings: TuneSettings) -> tuple[int, dict[str, Any]]:
    """Trial 0 of a new study: its number and parameters, from the step's own sampler (in memory)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if settings.num_parallel == AUTO:
        # The sampler's start-up trials follow num_parallel, and the preview reads no cluster; any
        # number gives trial 0 the same draw (every sampler draws it at random, or from enqueue).
        settings = settings.model_copy(update={"num_parallel": 1})
    study = optuna.create_study(
        storage=InMemoryStorage(),
        directions=[goal.direction for goal in settings.study.goals],
        sampler=make_sampler(settings),
    )
    for params in settings.enqueue:
        study.enqueue_trial(params, skip_if_exists=True)
    reseed_for_next_trial(study, settings, 0)
    trial = study.ask(distributions(settings.space))
    return trial.number, dict(trial.params)


def _dataset(spec: PipelineSpec, step: str, shared: SharedRoot) -> Path:
    """Where the step's needed stage step puts its dataset."""
    for needed in spec.steps[step].needs:
        body = spec.steps[needed]
        if isinstance(body, StageStep):
            return staged_path(shared, body.with_)
    raise TunepodError(f"step {step} needs no stage step: nothing tells its dataset")  # the DAG refuses it


def _native(launcher: str, payload: Any, job: JobSpec) -> str:
    """A payload in the form a person would hand the platform: the batch script as it is, the
    manifest as YAML (``kubectl apply -f``), the request as JSON (``aws sagemaker create-training-job
    --cli-input-json``), the local command as a shell line after its environment."""
    if isinstance(payload, str):
        return payload if payload.endswith("\n") else payload + "\n"
    if launcher == "local":
        env = "".join(f"export {key}={shlex.quote(value)}\n" for key, value in sorted(job.env.items()))
        return env + shlex.join(payload) + "\n"
    if launcher == "hyperpod_eks":
        return str(yaml.safe_dump(payload, sort_keys=False, width=120))
    return json.dumps(payload, indent=2) + "\n"
