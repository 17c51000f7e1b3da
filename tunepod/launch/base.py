"""The launcher contract every backend implements (local processes today; Slurm, HyperPod EKS and
SageMaker plug in behind the same two protocols).

A job is a command, never a pickled function: clusters do not share the orchestrator's Python. The
orchestrator hands the job everything through environment variables (see ``tunepod.runtime``) and
learns its outcome from the files the job writes under ``job_dir`` (see ``JobPaths``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from tunepod.launch.paths import JobPaths


class JobState(StrEnum):
    """The lifecycle every backend maps its own states onto."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class Resources(BaseModel):
    """What one job asks for, in one vocabulary that each backend maps onto its own.

    A backend warns once about a field it cannot honour rather than failing silently.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_nodes: int = Field(1, ge=1, description="Machines the job spans.")
    procs_per_node: int = Field(
        1, ge=1, description="Training processes per machine (torchrun --nproc-per-node)."
    )
    gpus_per_node: int = Field(0, ge=0, description="Accelerators per machine; 0 runs on CPU.")
    instance_type: str | None = Field(None, description="Cloud instance type (SageMaker, HyperPod).")
    timeout_min: float | None = Field(
        None, gt=0, description="Wall-clock limit; the job is cancelled after it."
    )


@dataclass(frozen=True)
class JobSpec:
    """One job to run: a Python entrypoint under torchrun, its arguments and environment."""

    name: str
    entrypoint: Path
    job_dir: Path
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)

    @property
    def paths(self) -> JobPaths:
        return JobPaths(self.job_dir)


@runtime_checkable
class JobHandle(Protocol):
    """A submitted job, shaped like a future. Safe to query from several threads."""

    job_id: str
    job_dir: Path

    def state(self) -> JobState:
        """The job's current state; never blocks for long."""
        ...

    def cancel(self) -> None:
        """Stop the job and everything it started. Idempotent; returns once the job has ended."""
        ...

    def logs(self, tail: int = 50) -> str:
        """The last ``tail`` lines of the job's stderr (stdout where stderr is empty)."""
        ...

    def describe(self) -> str:
        """One line on how the backend saw the job end (exit code, scheduler state and reason)."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Starts jobs on one backend and finds them again after the orchestrator restarts."""

    kind: str

    def submit(self, job: JobSpec) -> JobHandle:
        """Start ``job``; returns as soon as the backend has accepted it."""
        ...

    def attach(self, job_id: str, job_dir: Path) -> JobHandle:
        """A handle on a job submitted earlier, possibly by another process."""
        ...


def wait(handle: JobHandle, poll_s: float = 0.5, timeout_s: float | None = None) -> JobState:
    """Block until ``handle`` reaches a terminal state (or ``timeout_s`` passes) and return it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not (state := handle.state()).is_terminal:
        if deadline is not None and time.monotonic() > deadline:
            return state
        time.sleep(poll_s)
    return state
