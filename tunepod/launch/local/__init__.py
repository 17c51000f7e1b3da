"""The local launcher: jobs as ``torchrun`` process trees (or one bare process) on this machine."""

from tunepod.launch.exit_code import read_exit_code
from tunepod.launch.local.launcher import LocalJob, LocalLauncher, LocalStatus, parse_job_id
from tunepod.launch.local.processes import LinuxProcesses, ProcessTable
from tunepod.launch.local.render import direct_argv, job_argv, torchrun_argv, wrapper_argv
from tunepod.launch.procfs import read_process_stat

__all__ = [
    "LinuxProcesses",
    "LocalJob",
    "LocalLauncher",
    "LocalStatus",
    "ProcessTable",
    "direct_argv",
    "job_argv",
    "parse_job_id",
    "read_exit_code",
    "read_process_stat",
    "torchrun_argv",
    "wrapper_argv",
]
