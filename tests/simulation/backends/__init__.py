"""The simulated backends, one per launcher kind.

Each gives every orchestrator process a *real* launcher of its kind (``SlurmLauncher``, ...) whose
calls reach a simulated cluster with that backend's own semantics, and draws from a seed its own
settings and faults. A backend module defines:

- a frozen settings class with ``kind``, ``describe()``, ``quiet()`` (the same without faults) and
  ``make(machine) -> Backend``; a backend behind an API (Slurm's controller, the Kubernetes API
  server, SageMaker) draws its API's faults as ``ServiceFaults`` (``service_faults``), plus its own;
- ``draw(random) -> settings``, registered in ``DRAWS`` below.

Every call to a backend's API takes time, each way (the seed's ``Latency.api``: ``Scheduler.takes``),
its caller waiting meanwhile with whatever locks it holds, as a thread blocked in a request does.

``Backend`` is what the run needs: a new launcher for an orchestrator (made inside its process), and
a switch to stop the backend's faults when the scenario's fault phase ends.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from simulation.cluster import Cluster
from simulation.invariants import Referee
from simulation.scheduler import Host, Scheduler
from tunepod.launch.base import Launcher


@dataclass(frozen=True)
class Machine:
    """What a backend may use of the run: the scheduler, the cluster's ground truth, the referee, the
    shared root (job dirs live under it), the compute nodes, and the host the orchestrators run on
    (where the local launcher's jobs run too)."""

    sim: Scheduler
    cluster: Cluster
    referee: Referee
    root: Path
    nodes: tuple[Host, ...]
    orchestrator_host: Host


class Backend(Protocol):
    def launcher(self) -> Launcher:
        """A new launcher for the orchestrator process that calls it."""
        ...

    def faults_stop(self) -> None: ...


class BackendSettings(Protocol):
    @property
    def kind(self) -> str: ...

    def describe(self) -> str: ...

    def quiet(self) -> BackendSettings: ...

    def make(self, machine: Machine) -> Backend: ...


def rate(draw: random.Random, high: float) -> float:
    """A fault rate: off in about half the seeds, so that every fault is also seen alone."""
    return 0.0 if draw.random() < 0.5 else draw.uniform(0.0, high)


@dataclass(frozen=True)
class ServiceFaults:
    """The faults of a backend's API, each per call."""

    transient: float = 0.0
    """A call fails before it takes effect (no answer, throttled, 5xx; botocore's or the client's own
    retries spent)."""
    lost_reply: float = 0.0
    """A call that changes something (submit, create, cancel, delete, stop) takes effect, and its reply
    is lost."""
    outage: float = 0.0
    """A lost reply is the start of an outage (a partition, a failover): for up to a minute after it,
    every call fails before it takes effect, the look-ups that would find the lost reply's job too."""


def service_faults(draw: random.Random) -> dict[str, float]:
    """``ServiceFaults``' fields drawn from a seed: keyword arguments for a backend's faults class."""
    return {"transient": rate(draw, 0.1), "lost_reply": rate(draw, 0.2), "outage": rate(draw, 0.5)}


@dataclass
class Outage:
    """An API's outage window (``ServiceFaults.outage``), opened by a lost reply."""

    until: float = 0.0

    def begins(self, sim: Scheduler, faults: ServiceFaults) -> None:
        """After a lost reply: maybe the service stays out of reach a while."""
        if sim.choices.chance(faults.outage):
            self.until = sim.now + sim.choices.uniform(1.0, 60.0)
            sim.trace.event(sim.now, "fault", f"the API is out of reach until {self.until:.2f}s")

    def on(self, sim: Scheduler) -> bool:
        return sim.now < self.until


def draws() -> dict[str, Callable[[random.Random], BackendSettings]]:
    """Each backend kind's ``draw``."""
    from simulation.backends import hyperpod_eks, local, sagemaker, slurm

    return {
        "slurm": slurm.draw,
        "sagemaker": sagemaker.draw,
        "hyperpod_eks": hyperpod_eks.draw,
        "local": local.draw,
    }


KINDS = ("slurm", "sagemaker", "hyperpod_eks", "local")
