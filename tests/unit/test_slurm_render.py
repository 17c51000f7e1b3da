"""``render_sbatch`` against stored scripts in ``tests/unit/golden`` (submitit's way), plus the pure
helpers around it: quoting for #SBATCH lines and for the shell, limits, and what is refused.

Regenerate the stored scripts after an intended change with
``TUNEPOD_UPDATE_GOLDEN=1 .venv/bin/pytest tests/unit/test_slurm_render.py`` and review the diff.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tunepod.errors import TunepodError
from tunepod.launch.base import SUBMISSION_ID_ENV, JobSpec, Resources
from tunepod.launch.slurm import (
    SCRIPT_NAME,
    SlurmLauncher,
    detect_hyperpod,
    format_mem,
    format_time_limit,
    ignored_resources,
    render_sbatch,
    sbatch_value,
    slurm_resources,
)
from tunepod.launch.slurm import render as slurm_render
from tunepod.runtime import CHECKPOINT_DIR_ENV, CHECKPOINT_TIERS_ENV
from tunepod.runtime.memory_store import job_folder
from tunepod.runtime.tiers import CheckpointTiers
from tunepod.spec.models import SlurmLauncherSpec

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("TUNEPOD_UPDATE_GOLDEN") == "1"


def assert_matches_golden(name: str, text: str) -> None:
    """``text`` equals ``golden/<name>.sbatch``; with TUNEPOD_UPDATE_GOLDEN=1 it (re)writes the file."""
    path = GOLDEN / f"{name}.sbatch"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} is missing; create it with TUNEPOD_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{path} differs; if intended, regenerate with TUNEPOD_UPDATE_GOLDEN=1"


def spec(**fields: object) -> SlurmLauncherSpec:
    return SlurmLauncherSpec.model_validate({"kind": "slurm", "root": "/fsx/tunepod", **fields})


DEFAULT_JOB = JobSpec(
    name="digits-trial-7",
    entrypoint=Path("/fsx/tunepod/code/train.py"),
    job_dir=Path("/fsx/tunepod/jobs/digits/trial-7"),
)


def job(**fields: Any) -> JobSpec:
    return dataclasses.replace(DEFAULT_JOB, **fields)


def test_minimal_job_renders_the_defaults() -> None:
    """One process on one node: srun starts the interpreter with torchrun's variables."""
    assert_matches_golden("minimal", render_sbatch(job(), spec(), hyperpod=False))


def test_a_single_process_keeps_torchrun_when_the_spec_asks() -> None:
    script = render_sbatch(job(), spec(direct_single_process=False), hyperpod=False)
    assert_matches_golden("minimal_torchrun", script)


def test_an_elastic_job_runs_torchrun_min_to_max_and_survives_a_node_loss() -> None:
    """min_nodes: torchrun's --nnodes=min:max, one re-forming per node it may lose, and --no-kill on
    the job (Slurm keeps the allocation) and on srun (the other nodes' tasks go on)."""
    elastic = job(resources=Resources(num_nodes=4, min_nodes=2, procs_per_node=2))
    script = render_sbatch(elastic, spec(), hyperpod=False)
    assert_matches_golden("elastic", script)
    assert "#SBATCH --no-kill" in script
    assert "srun --no-kill" in script
    assert "--nnodes 2:4 --nproc-per-node 2" in script
    assert "--max-restarts 2 --rdzv-conf last_call_timeout=5," in script


def test_min_nodes_equal_to_num_nodes_is_not_elastic() -> None:
    fixed = job(resources=Resources(num_nodes=2, min_nodes=2))
    assert render_sbatch(fixed, spec(), hyperpod=False) == render_sbatch(
        job(resources=Resources(num_nodes=2)), spec(), hyperpod=False
    )


def test_every_option_set_on_hyperpod() -> None:
    full = spec(
        partition="gpu",
        account="ml-team",
        qos="high",
        exclusive=True,
        cpus_per_node=32,
        mem_gb=240,
        time_limit_min=600,
        python="/fsx/envs/train/bin/python",
        setup=["source /fsx/envs/train/bin/activate", "module load cuda/12.4"],
        env={"NCCL_DEBUG": "WARN", "TUNEPOD_TRIAL": "overridden by the job"},
    )
    resources = Resources(num_nodes=4, procs_per_node=8, gpus_per_node=8, timeout_min=90.5)
    # As the launcher sends it: with the submission id, which adds the --comment line.
    env = {"TUNEPOD_TRIAL": "7", "TUNEPOD_PARAMS": '{"lr": 0.01}', SUBMISSION_ID_ENV: "0123456789abcdef"}
    rendered = job(args=("--epochs", "12"), env=env, resources=resources)
    assert_matches_golden("full_hyperpod", render_sbatch(rendered, full, hyperpod=True))


def test_the_submission_id_becomes_the_comment_find_looks_for() -> None:
    script = render_sbatch(job(env={SUBMISSION_ID_ENV: "0123456789abcdef"}), spec(), hyperpod=False)
    assert "#SBATCH --comment=tunepod:0123456789abcdef\n" in script
    assert "--comment" not in render_sbatch(job(), spec(), hyperpod=False)


def test_launcher_renders_the_script_under_the_job_name(tmp_path: Path) -> None:
    launcher = SlurmLauncher(spec(root=str(tmp_path), hyperpod=False))
    sent = job(env={SUBMISSION_ID_ENV: "0123456789abcdef"})
    rendered = launcher.render(sent, attempt=3)
    assert rendered.name == sent.name
    assert rendered.payload == render_sbatch(sent, launcher.spec, hyperpod=False)
    assert rendered.files == {SCRIPT_NAME: rendered.payload}


def test_awkward_names_paths_and_values() -> None:
    weird_dir = Path('/fsx/tunepod/jobs/it\'s a "quoted" #dir %j $HOME')
    rendered = job(
        name="trial 7 'quoted'",
        entrypoint=Path("/fsx/code dir/train $1.py"),
        job_dir=weird_dir,
        args=("$HOME", "a  b", "it's", '"q"', "`id`", "*", ""),
        env={"TUNEPOD_PARAMS": '{"name": "it\'s $HOME"}', "MULTILINE": "one\ntwo"},
    )
    assert_matches_golden(
        "awkward", render_sbatch(rendered, spec(partition="a b", mem_gb=0.5), hyperpod=False)
    )


def test_rendered_scripts_are_valid_bash() -> None:
    for golden in sorted(GOLDEN.glob("*.sbatch")):
        checked = subprocess.run(["bash", "-n", str(golden)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{golden.name}: {checked.stderr}"


def test_entrypoint_and_args_survive_the_shell_exactly() -> None:
    args = ("$HOME", "a  b", "it's", '"q"', "`id`", "*", "$(true)", "")
    entrypoint = Path("/code dir/it's train.py")
    script = render_sbatch(job(entrypoint=entrypoint, args=args), spec(), hyperpod=False)
    command = script.split("srun", 1)[1].replace("\\\n", " ")
    words = shlex.split(command)
    assert words[-len(args) - 1 :] == [str(entrypoint), *args]


def test_env_values_survive_the_shell_exactly() -> None:
    env = {"PLAIN": "x", "SPACES": "a  b", "QUOTES": 'it\'s "q"', "DOLLAR": "$HOME `id`", "NL": "1\n2"}
    script = render_sbatch(job(env=env), spec(), hyperpod=False)
    # The export block runs up to the next blank line (a multi-line value spans several lines).
    start = script.index("export ")
    block = script[start : script.index("\n\n", start)]
    probe = block + "\n" + "".join(f'printf "%s\\0" "${name}"\n' for name in env)
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split("\0")[:-1] == list(env.values())


def test_job_env_wins_over_launcher_env() -> None:
    script = render_sbatch(job(env={"SHARED": "job"}), spec(env={"SHARED": "launcher"}), hyperpod=False)
    assert "export SHARED=job" in script
    assert "launcher" not in script


def test_auto_resume_only_on_hyperpod() -> None:
    assert "srun --auto-resume=1 " in render_sbatch(job(), spec(), hyperpod=True)
    assert "--auto-resume" not in render_sbatch(job(), spec(), hyperpod=False)


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"name": "trial\n7"}, "job name"),
        ({"job_dir": Path("/fsx/jobs/a\nb")}, "job dir"),
        ({"name": "trial\r7"}, "job name"),
    ],
)
def test_line_breaks_in_sbatch_lines_are_refused_naming_the_field(
    fields: dict[str, object], field_name: str
) -> None:
    with pytest.raises(TunepodError, match=f"^{field_name} .* line break"):
        render_sbatch(job(**fields), spec(), hyperpod=False)


def test_line_break_in_partition_is_refused() -> None:
    with pytest.raises(TunepodError, match=r"^partition .* line break"):
        render_sbatch(job(), spec(partition="gpu\n#SBATCH --qos=high"), hyperpod=False)


def test_invalid_env_name_is_refused() -> None:
    with pytest.raises(TunepodError, match="'BAD NAME' is not a valid shell name"):
        render_sbatch(job(env={"BAD NAME": "x"}), spec(), hyperpod=False)


@pytest.mark.parametrize(
    ("value", "rendered"),
    [
        ("plain-name_1.2", "plain-name_1.2"),
        ("a b", '"a b"'),
        ("it's", '"it\'s"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
        ("#1", '"#1"'),
    ],
)
def test_sbatch_value_quotes_for_sbatchs_own_parser(value: str, rendered: str) -> None:
    assert sbatch_value("job name", value) == rendered


@pytest.mark.parametrize(
    ("minutes", "expected"),
    [(1, "00:01:00"), (0.1, "00:01:00"), (59.5, "01:00:00"), (90, "01:30:00"), (24 * 60 + 1, "1-00:01:00")],
)
def test_time_limit_rounds_up_to_whole_minutes(minutes: float, expected: str) -> None:
    assert format_time_limit(minutes) == expected


@pytest.mark.parametrize(("gb", "expected"), [(16, "16G"), (16.0, "16G"), (0.5, "512M"), (1.001, "1026M")])
def test_memory_in_whole_gigabytes_or_megabytes(gb: float, expected: str) -> None:
    assert format_mem(gb) == expected


def test_job_timeout_wins_over_the_launcher_default() -> None:
    launcher = spec(time_limit_min=60)
    assert slurm_resources(Resources(timeout_min=5), launcher).time_limit_min == 5
    assert slurm_resources(Resources(), launcher).time_limit_min == 60
    assert slurm_resources(Resources(), spec()).time_limit_min is None
    assert "--time" not in render_sbatch(job(), spec(), hyperpod=False)


def test_instance_type_is_the_only_ignored_resource() -> None:
    assert ignored_resources(Resources(num_nodes=3, gpus_per_node=8, timeout_min=5)) == {}
    ignored = ignored_resources(Resources(instance_type="ml.p5.48xlarge"))
    assert list(ignored) == ["instance_type"]
    assert "ml.p5.48xlarge" in ignored["instance_type"]


def test_hyperpod_is_declared_or_detected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    marker = tmp_path / "sagemaker_cluster"
    monkeypatch.setattr(slurm_render, "HYPERPOD_MARKER", marker)
    assert detect_hyperpod(spec()) is False
    marker.mkdir()
    assert detect_hyperpod(spec()) is True
    assert detect_hyperpod(spec(hyperpod=False)) is False
    assert detect_hyperpod(spec(hyperpod=True)) is True


def tiered_job(job_dir: Path, memory_dir: Path) -> JobSpec:
    """A job with checkpoint tiers: its env names the memory folder every node keeps for it."""
    tiers = CheckpointTiers(
        memory_every_steps=1, shared_every_steps=3, memory_replicas=1, memory_dir=str(memory_dir)
    )
    env = {CHECKPOINT_TIERS_ENV: tiers.to_json(), CHECKPOINT_DIR_ENV: str(job_dir / "checkpoints")}
    return job(job_dir=job_dir, env=env)


def test_a_job_with_checkpoint_tiers_removes_its_memory_folder_on_every_node_before_its_exit_code() -> None:
    job_dir = Path("/fsx/tunepod/jobs/digits/trial-7")
    script = render_sbatch(tiered_job(job_dir, Path("/dev/shm")), spec(), hyperpod=False)
    assert_matches_golden("checkpoint_tiers", script)
    folder = job_folder("/dev/shm", job_dir / "checkpoints")
    assert f"tunepod_memory={folder}" in script
    assert "trap 'code=$?; tunepod_forget_memory; printf" in script


@pytest.mark.parametrize(
    ("job_state", "num_nodes", "removed"),
    [("RUNNING", 2, "on every node"), ("RUNNING", 1, "here"), ("REQUEUED", 2, ""), ("PENDING", 2, "")],
)
def test_the_exit_trap_removes_the_memory_folder_unless_slurm_requeues_the_job(
    tmp_path: Path, job_state: str, num_nodes: int, removed: str
) -> None:
    """The rendered script of a two-node job, run by bash with stand-ins for ``srun`` (records that it
    ran, then runs its command here) and ``scontrol`` (the job in ``job_state`` on ``num_nodes``), its
    training command failing: the folder goes when the job is still RUNNING (it ends for good), by a
    step on every node while it holds both, from this node alone once an elastic job lost one (a step
    would wait for the lost node); it stays when Slurm is requeueing the job. The exit code is the
    command's, and is recorded."""
    bin_dir, memory_dir, job_dir = tmp_path / "bin", tmp_path / "shm", tmp_path / "job"
    bin_dir.mkdir()
    job_dir.mkdir()
    srun_log = tmp_path / "srun.log"
    (bin_dir / "srun").write_text(
        f'#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\necho "$1" >> {srun_log}\nexec "$@"\n'
    )
    (bin_dir / "scontrol").write_text(
        f"#!/bin/sh\necho 'JobId=7 JobState={job_state} Reason=None NumNodes={num_nodes} NumCPUs=2'\n"
    )
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    folder = job_folder(memory_dir, job_dir / "checkpoints")
    (folder / "step-000004").mkdir(parents=True)
    two_nodes = dataclasses.replace(tiered_job(job_dir, memory_dir), resources=Resources(num_nodes=2))
    script = render_sbatch(two_nodes, spec(python="/bin/false"), hyperpod=False)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"}
    env |= {"SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1, done.stderr
    assert folder.exists() is not bool(removed)
    assert ("rm" in srun_log.read_text().split()) is (removed == "on every node"), done.stderr
    assert (job_dir / "exit_code").read_text().split() == ["1", "7"]
