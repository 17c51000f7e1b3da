"""The batch script of a Slurm job (pure, golden-tested in ``tests/unit/golden/*.sbatch``).

The script runs one task per node, and that task is ``torchrun`` with ``procs_per_node`` workers and
a c10d rendezvous on the first node of the allocation; a job of one process on one node runs the
interpreter directly instead, with the variables torchrun would set (``direct_single_process``).
Jobs are submitted with ``--requeue`` and ``--open-mode=append``: a requeued (or HyperPod
auto-resumed) job starts again in the same job dir, appends to the same logs and resumes from its own
checkpoints.

A job whose environment carries ``SUBMISSION_ID_ENV`` (every job the launcher sends) also carries
``--comment=tunepod:<submission id>``: the job name is the same for every attempt in a job dir, and
the comment is how ``find`` tells this attempt's job from an earlier one's.

The script's ``EXIT`` trap writes its exit code, submission id and job id to the job dir
(``tunepod.launch.exit_code``): once Slurm has purged an ended job (``MinJobAge``) and no
accounting remembers it, that file is how a finished job is told from a failed one, and how an
intent whose job id never reached the record finds its job.

A job with checkpoint tiers keeps a memory folder on each of its nodes, which only ``ctx.finish``
removes. When the script ends by itself without it (a rank failed or was killed, torchrun gave up),
the ``EXIT`` trap first removes that folder on every node with one ``srun`` task per node, then
records the exit code (after which the orchestrator may start the next attempt, whose folder has the
same name). Only while Slurm still has the job RUNNING: once a node was lost Slurm requeues the job
(the survivors' steps are signalled, and the trap runs), and the requeued job restores from the
survivors' memory, so they keep it. An elastic job that lost a node and went on holds fewer nodes
than it started with; a step on every node would wait for the lost one, so the folder is removed on
the first node alone (the batch script's, which survived: had it not, the launcher would have
requeued the job). A job cancelled outright or at its time limit is not RUNNING either, and Slurm
refuses new steps of an ending job:
its folders stay until their node restarts (Slurm's ``Epilog`` could remove them, but it is cluster
configuration the user owns). A stop with ``stop_grace_s`` signals the tasks alone: the script ends
while the job runs, and the folders go. A new job after a pause or a failure restores from the
shared file system.

An elastic job (``resources.min_nodes`` below ``num_nodes``) runs torchrun with ``--nnodes=min:max``
and ``--max-restarts``, and asks Slurm not to end it when a node fails: ``--no-kill`` on the job keeps
the allocation (Slurm's default revokes it, and requeues the job), and on ``srun`` keeps the step's
tasks on the other nodes running (by default srun kills the whole step). The survivors' agents then
re-form without the lost node. The first node runs the batch script and hosts the rendezvous: no
survivor can go on without it, and the launcher requeues the job (``SlurmLauncher``), which restores
from its checkpoints as any other job.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tunepod.errors import TunepodError
from tunepod.launch.base import SINGLE_PROCESS_ENV, SUBMISSION_ID_ENV, JobSpec, Resources
from tunepod.launch.contract import memory_folder
from tunepod.launch.elastic import rdzv_conf
from tunepod.launch.paths import JobPaths
from tunepod.spec.models import SlurmLauncherSpec

HYPERPOD_MARKER = Path("/opt/sagemaker_cluster")
"""Present on the nodes of a SageMaker HyperPod cluster; its srun then understands --auto-resume."""
SCRIPT_NAME = "job.sbatch"
COMMENT_PREFIX = "tunepod:"
RDZV_BASE_PORT = 20000
RDZV_PORT_RANGE = 20000


def submission_comment(submission_id: str) -> str:
    """The ``--comment`` that marks the job of one submission."""
    return f"{COMMENT_PREFIX}{submission_id}"


def detect_hyperpod(spec: SlurmLauncherSpec) -> bool:
    """``spec.hyperpod`` when set, else whether this machine is a HyperPod node."""
    return spec.hyperpod if spec.hyperpod is not None else HYPERPOD_MARKER.exists()


@dataclass(frozen=True)
class SlurmResources:
    """``Resources`` in Slurm's terms."""

    nodes: int
    procs_per_node: int
    gpus_per_node: int
    time_limit_min: float | None


def slurm_resources(resources: Resources, spec: SlurmLauncherSpec) -> SlurmResources:
    """Map the generic resources; ``instance_type`` has no Slurm meaning (see ``ignored_resources``)."""
    return SlurmResources(
        nodes=resources.num_nodes,
        procs_per_node=resources.procs_per_node,
        gpus_per_node=resources.gpus_per_node,
        time_limit_min=resources.timeout_min if resources.timeout_min is not None else spec.time_limit_min,
    )


def ignored_resources(resources: Resources) -> dict[str, str]:
    """What Slurm cannot honour in ``resources``, keyed by field."""
    if resources.instance_type is None:
        return {}
    return {
        "instance_type": f"resources.instance_type={resources.instance_type!r} ignored: Slurm picks nodes "
        "by partition; set the launcher's partition instead"
    }


def format_time_limit(minutes: float) -> str:
    """``--time`` value: ``[D-]HH:MM:00``, rounded up to whole minutes (Slurm's resolution)."""
    total = max(1, math.ceil(minutes))
    days, rest = divmod(total, 24 * 60)
    hours, mins = divmod(rest, 60)
    clock = f"{hours:02d}:{mins:02d}:00"
    return f"{days}-{clock}" if days else clock


def format_mem(mem_gb: float) -> str:
    """``--mem`` value: whole gigabytes as ``NG``, anything else rounded up to megabytes."""
    return f"{int(mem_gb)}G" if float(mem_gb).is_integer() else f"{math.ceil(mem_gb * 1024)}M"


def sbatch_value(field: str, value: str) -> str:
    """``value`` as one argument of an ``#SBATCH`` line.

    sbatch reads these lines itself, not the shell: it groups characters in double quotes and takes
    the character after a backslash literally, so a value is double-quoted with ``\\`` and ``"``
    escaped. A newline cannot be written at all, so it is refused, naming ``field``.
    """
    if "\n" in value or "\r" in value:
        raise TunepodError(f"{field} {value!r} contains a line break, which an #SBATCH line cannot hold")
    if re.fullmatch(r"[A-Za-z0-9_./:=@+,-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_path(field: str, path: Path) -> str:
    """A path for ``--output``/``--error``, where sbatch expands ``%j``-style patterns: ``%`` is escaped."""
    return sbatch_value(field, str(path).replace("%", "%%"))


def sbatch_directives(job: JobSpec, spec: SlurmLauncherSpec) -> list[str]:
    """The ``#SBATCH`` options for ``job`` (without the ``#SBATCH`` prefix)."""
    res = slurm_resources(job.resources, spec)
    paths = JobPaths(job.job_dir)
    options = [f"--job-name={sbatch_value('job name', job.name)}"]
    if SUBMISSION_ID_ENV in job.env:
        comment = submission_comment(job.env[SUBMISSION_ID_ENV])
        options.append(f"--comment={sbatch_value('submission id', comment)}")
    options += [f"--nodes={res.nodes}", "--ntasks-per-node=1"]
    if spec.cpus_per_node is not None:
        options.append(f"--cpus-per-task={spec.cpus_per_node}")
    if res.gpus_per_node > 0:
        options.append(f"--gpus-per-node={res.gpus_per_node}")
    if spec.mem_gb is not None:
        options.append(f"--mem={format_mem(spec.mem_gb)}")
    if res.time_limit_min is not None:
        options.append(f"--time={format_time_limit(res.time_limit_min)}")
        # SIGTERM to every task this long before the limit, so the script checkpoints (ctx.should_stop()).
        # Not B: (the batch shell alone): the tasks are what must see it. Stops and requeues signal them
        # anyway, with the cluster's KillWait as the grace.
        options.append(f"--signal=TERM@{job.resources.time_limit_warning_s}")
    for flag, value in (("partition", spec.partition), ("account", spec.account), ("qos", spec.qos)):
        if value is not None:
            options.append(f"--{flag}={sbatch_value(flag, value)}")
    if spec.exclusive:
        options.append("--exclusive")
    if job.resources.elastic:
        options.append("--no-kill")  # a failed node leaves the allocation to the others (module docstring)
    options += [
        "--requeue",
        "--open-mode=append",
        f"--output={sbatch_path('job dir', paths.stdout)}",
        f"--error={sbatch_path('job dir', paths.stderr)}",
    ]
    return options


def job_environment(job: JobSpec, spec: SlurmLauncherSpec) -> dict[str, str]:
    """The variables the script exports: the launcher's ``env``, then the job's (which wins)."""
    env = {**spec.env, **job.env}
    for name in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise TunepodError(f"environment variable name {name!r} is not a valid shell name")
    return env


def torchrun_command(job: JobSpec, spec: SlurmLauncherSpec, *, hyperpod: bool) -> str:
    """The ``srun ... torchrun`` command (continued over lines): one torchrun per node, rendezvous on
    the first node."""
    res = slurm_resources(job.resources, spec)
    elastic = job.resources.elastic
    nnodes = f"--nnodes {job.resources.nnodes}" if elastic else '--nnodes "$SLURM_NNODES"'
    lines = [
        " ".join(_srun(spec, hyperpod=hyperpod, elastic=elastic)),
        f"{shlex.quote(spec.python)} -m torch.distributed.run",
        f"{nnodes} --nproc-per-node {res.procs_per_node}",
        '--rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_node:$rdzv_port"',
    ]
    if elastic:
        lines.append(f"--max-restarts {job.resources.elastic_restarts} --rdzv-conf {rdzv_conf()}")
    lines.append(shlex.join([str(job.entrypoint), *job.args]))
    return " \\\n  ".join(lines)


def direct_command(job: JobSpec, spec: SlurmLauncherSpec, *, hyperpod: bool) -> str:
    """``srun`` starting the interpreter itself, with the variables torchrun would set for its only
    worker: a job of one process on one node needs no rendezvous, and torchrun costs seconds."""
    variables = [f"{name}={value}" for name, value in SINGLE_PROCESS_ENV.items()]
    lines = [
        " ".join(_srun(spec, hyperpod=hyperpod)),
        shlex.join(["/usr/bin/env", *variables]),
        shlex.join([spec.python, str(job.entrypoint), *job.args]),
    ]
    return " \\\n  ".join(lines)


def _srun(spec: SlurmLauncherSpec, *, hyperpod: bool, elastic: bool = False) -> list[str]:
    srun = ["srun", "--auto-resume=1"] if hyperpod else ["srun"]
    if elastic:
        srun.append("--no-kill")  # a failed node's tasks end, the others' go on (module docstring)
    if spec.cpus_per_node is not None:
        # Slurm 22.05's srun no longer inherits --cpus-per-task from the batch job: without this the
        # task, and every worker it starts, would be bound to a single CPU.
        srun.append(f"--cpus-per-task={spec.cpus_per_node}")
    return srun


def exit_code_trap(paths: JobPaths, *, forget_memory: bool = False) -> list[str]:
    """The lines that make the script record how it ended in the job dir (see the module docstring);
    with ``forget_memory``, after calling ``tunepod_forget_memory`` (``memory_cleanup``): the exit
    code tells the orchestrator it may start the next attempt, whose memory must not be removed."""
    first = "tunepod_forget_memory; " if forget_memory else ""  # the script's exit code stays $code
    return [
        "# How the script ended, kept in the job dir for when Slurm has forgotten the job (MinJobAge).",
        f"tunepod_exit={shlex.quote(str(paths.exit_code))}",
        f"trap 'code=$?; {first}"
        'printf "%s %s %s\\n" "$code" "${TUNEPOD_SUBMISSION_ID:-}" "${SLURM_JOB_ID:-}" '
        '> "$tunepod_exit.tmp" && mv -f "$tunepod_exit.tmp" "$tunepod_exit"\' EXIT',
    ]


def memory_cleanup(folder: Path | None) -> list[str]:
    """The shell function the ``EXIT`` trap calls to remove the job's memory folder (its checkpoint
    tiers', ``folder``) on every node; none without tiers (see the module docstring)."""
    if folder is None:
        return []
    return [
        "# The memory tier's folder on every node: ctx.finish removes it, a script that ended otherwise",
        "# (a rank failed or was killed) removes it here, once the job ends for good. Not when Slurm",
        "# requeues the job (a node was lost): the requeued job restores from the survivors' memory.",
        "# An elastic job that lost a node holds fewer nodes than it started with, and a step on all of",
        "# them would wait for the lost one: the folder goes from this node (the first, which survived).",
        f"tunepod_memory={shlex.quote(str(folder))}",
        "tunepod_forget_memory() {",
        "  local job",
        '  job=$(scontrol --oneliner show job "$SLURM_JOB_ID" 2>/dev/null) || return 0',
        '  case "$job" in *JobState=RUNNING*) ;; *) return 0 ;; esac',
        '  case "$job" in',
        '    *" NumNodes=$SLURM_JOB_NUM_NODES "*)',
        "      timeout 60 srun --ntasks-per-node=1 --kill-on-bad-exit=0 \\",
        '        rm -rf -- "$tunepod_memory" || true ;;',
        '    *) rm -rf -- "$tunepod_memory" ;;',
        "  esac",
        "}",
    ]


def render_sbatch(job: JobSpec, spec: SlurmLauncherSpec, *, hyperpod: bool) -> str:
    """The batch script that runs ``job`` (pure). Raises ``TunepodError`` for what it cannot express."""
    header = ["#!/bin/bash", *(f"#SBATCH {option}" for option in sbatch_directives(job, spec))]
    exports = [f"export {name}={shlex.quote(value)}" for name, value in job_environment(job, spec).items()]
    res = slurm_resources(job.resources, spec)
    if spec.direct_single_process and res.nodes == 1 and res.procs_per_node == 1:
        launch = [
            "# One process on one node: no torchrun, no rendezvous.",
            direct_command(job, spec, hyperpod=hyperpod),
        ]
    else:
        launch = [
            "# torchrun's c10d rendezvous is served from the first node; the port follows the job id so",
            "# that jobs sharing a node do not collide. No `| head -n 1`: under pipefail, a long node list",
            "# would kill scontrol with SIGPIPE, and the script with it.",
            'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            "head_node=${nodes%%$'\\n'*}",
            f"rdzv_port=$(({RDZV_BASE_PORT} + SLURM_JOB_ID % {RDZV_PORT_RANGE}))",
            torchrun_command(job, spec, hyperpod=hyperpod),
        ]
    folder = memory_folder(job.env)
    trap = [*memory_cleanup(folder), *exit_code_trap(JobPaths(job.job_dir), forget_memory=folder is not None)]
    blocks = [header, ["set -euo pipefail"], exports, trap, list(spec.setup), launch]
    return "\n\n".join("\n".join(block) for block in blocks if block) + "\n"
