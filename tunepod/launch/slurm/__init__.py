"""The Slurm launcher: jobs as sbatch jobs, here or on a head node over ssh.

``render.py`` builds the batch script (pure), ``states.py`` reads what Slurm says, ``commands.py``
runs Slurm's clients, and ``launcher.py`` fills in the launcher template with them.
"""

from tunepod.launch.slurm.launcher import SlurmLauncher
from tunepod.launch.slurm.render import (
    HYPERPOD_MARKER,
    SCRIPT_NAME,
    SlurmResources,
    detect_hyperpod,
    format_mem,
    format_time_limit,
    ignored_resources,
    render_sbatch,
    sbatch_value,
    slurm_resources,
    submission_comment,
)
from tunepod.launch.slurm.states import (
    SLURM_STATES,
    SlurmStatus,
    map_slurm_state,
    parse_exit_code,
    parse_job_id,
    parse_job_listing,
    parse_sacct,
    parse_scontrol_job,
    parse_squeue,
    purged_status,
)

__all__ = [
    "HYPERPOD_MARKER",
    "SCRIPT_NAME",
    "SLURM_STATES",
    "SlurmLauncher",
    "SlurmResources",
    "SlurmStatus",
    "detect_hyperpod",
    "format_mem",
    "format_time_limit",
    "ignored_resources",
    "map_slurm_state",
    "parse_exit_code",
    "parse_job_id",
    "parse_job_listing",
    "parse_sacct",
    "parse_scontrol_job",
    "parse_squeue",
    "purged_status",
    "render_sbatch",
    "sbatch_value",
    "slurm_resources",
    "submission_comment",
]
