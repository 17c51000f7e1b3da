"""``tunepod render``: what a trial would send, sent nowhere, and the same as what a run sends.

Here, the local launcher end to end (``tunepod render`` then ``tunepod run`` of the same spec: the
command line and the environment the trial's process really got), and the command's errors. Each
remote launcher's rendering is compared with what its backend received in that launcher's tests
(``test_slurm_launcher``: the batch script slurmctld stored; ``test_hyperpod_eks_launcher``: the
object the API server stored; ``test_sagemaker_contract``: the CreateTrainingJob request).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_study import REPO, write_tiny_study

from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.preview import RUN_ID_PLACEHOLDER

ENV_ECHO = REPO / "tests" / "fixtures" / "trainers" / "env_echo.py"
SECRET = "rEnder-s3cret"


def tunepod(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "COLUMNS": "200", "TUNEPOD_RUNNER": "off", **env}
    return subprocess.run(
        [sys.executable, "-m", "tunepod.cli", *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def exports_and_command(rendered: str) -> tuple[dict[str, str], list[str]]:
    """The local rendering read back: its ``export`` lines, and its command line (the lines after)."""
    env, command = {}, []
    lines = [line for line in rendered.splitlines() if not line.startswith("#")]
    exports = [line for line in lines if line.startswith("export ")]
    for line in exports:
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = shlex.split(value)[0] if value else ""
    command = shlex.split("\n".join(lines[len(exports) :]))
    return env, command


@pytest.mark.slow
def test_render_shows_the_command_and_environment_tunepod_run_gives_the_first_trial(
    prefect_api: None, tmp_path: Path
) -> None:
    spec, jobs, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1, trainer=ENV_ECHO)
    rendered = tunepod("render", str(spec))
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout.startswith(
        f"# step search: trial 0 of study tiny, launcher local, job dir {jobs}/trial-0"
    )
    shown_env, shown_command = exports_and_command(rendered.stdout)

    from prefect.settings import PREFECT_API_URL

    ran = tunepod(
        "run", str(spec), "--home", str(tmp_path / "no-stack"), PREFECT_API_URL=str(PREFECT_API_URL.value())
    )
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-4000:]
    record = read_submission(JobPaths(jobs / "trial-0"))
    assert record is not None and record.attempt == 1
    given = json.loads((jobs / "trial-0" / "env.json").read_text())

    def as_run(value: str) -> str:
        shown_id = shown_env["TUNEPOD_SUBMISSION_ID"]
        return value.replace(shown_id, record.submission_id).replace(
            RUN_ID_PLACEHOLDER, given["MLFLOW_RUN_ID"]
        )

    assert {key: as_run(value) for key, value in shown_env.items()} == {key: given[key] for key in shown_env}
    assert [as_run(arg) for arg in shown_command] == record.details["argv"]
    assert json.loads(shown_env["TUNEPOD_PARAMS"])["x"] == json.loads(given["TUNEPOD_PARAMS"])["x"]


def test_render_hides_store_passwords(tmp_path: Path) -> None:
    spec, _, _ = write_tiny_study(tmp_path, f"postgresql://tunepod:{SECRET}@db.example:5432/mlflow", 1)
    rendered = tunepod("render", str(spec))
    assert rendered.returncode == 0, rendered.stderr
    assert "MLFLOW_TRACKING_URI=postgresql://tunepod:***@db.example:5432/mlflow" in rendered.stdout
    assert SECRET not in rendered.stdout + rendered.stderr


def test_render_of_a_step_that_is_no_tune_step_names_the_tune_steps(tmp_path: Path) -> None:
    spec, _, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1)
    rendered = tunepod("render", str(spec), "--step", "data")
    assert rendered.returncode == 2
    assert "--step 'data' is not a tune step of pipeline tiny; fix: name one of search" in rendered.stderr
    assert rendered.stdout == ""


def test_render_for_hyperpod_eks_reads_no_kubeconfig_and_refuses_what_a_run_would(tmp_path: Path) -> None:
    """A platform team reviews the manifest on a machine without the cluster's kubeconfig; the code must
    be under the claim's mount, as a run would say at its first submit."""
    code = tmp_path / "shared" / "code"
    code.mkdir(parents=True)
    (code / "env_echo.py").write_text(ENV_ECHO.read_text())
    image = "123456789012.dkr.ecr.us-west-2.amazonaws.com/train:1"
    eks = {"kind": "hyperpod_eks", "image": image, "claim_name": "fsx-claim"}
    spec, _, _ = write_tiny_study(
        tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1, launcher=eks, trainer=code / "env_echo.py"
    )
    nowhere = {"KUBECONFIG": str(tmp_path / "no-kubeconfig"), "KUBERNETES_SERVICE_HOST": ""}
    rendered = tunepod("render", str(spec), **nowhere)
    assert rendered.returncode == 0, rendered.stderr
    assert "kind: HyperPodPyTorchJob" in rendered.stdout
    assert f"- {code / 'env_echo.py'}" in rendered.stdout

    outside, _, _ = write_tiny_study(
        tmp_path, f"sqlite:///{tmp_path}/mlflow.db", 1, launcher=eks, trainer=ENV_ECHO
    )
    refused = tunepod("render", str(outside), **nowhere)
    assert refused.returncode == 2
    assert f"entrypoint {ENV_ECHO} of job 'tiny-trial-0' is outside the launcher root" in refused.stderr
    assert refused.stdout == ""
