"""What ``sinfo`` says about a cluster's nodes, and how many trials its idle ones run at once (pure).

``num_parallel: auto`` on Slurm is the idle nodes of the launcher's partition (the spec's
``partition``, else the one sinfo marks default with ``*``) divided by a trial's ``num_nodes``. Idle
means free now: a node in state ``idle``, or ``idle~`` / ``idle#`` (powered down or powering up: power
saving starts it for a job, as cloud clusters do). A node that is not responding (``idle*``), held for a
pending job (``idle-``), in maintenance, rebooting or powering down is not counted, nor one partly used
(``mix``): a trial whose job waits for one still runs later, queued.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunepod.errors import TunepodError
from tunepod.launch.slots import Slots, counted, divided

SINFO_NODES_FORMAT = "%N|%P|%t"
"""``sinfo -h -N -o`` this: one line per node and partition: name, partition (``*``: the default),
compact state (``idle``, ``mix``, ``alloc``, ``drain``..., with a flag suffix such as ``*`` or ``~``)."""
IDLE_STATES = frozenset({"idle", "idle~", "idle#"})


@dataclass(frozen=True)
class NodeListing:
    """One node in one partition, as ``sinfo -N`` lists it."""

    name: str
    partition: str
    default: bool
    """The partition is the cluster's default (sinfo prints it with ``*``)."""
    state: str


def parse_sinfo_nodes(stdout: str) -> list[NodeListing]:
    """Lines of ``sinfo -h -N -o '%N|%P|%t'`` -> nodes."""
    nodes = []
    for line in stdout.splitlines():
        name, partition, state = ([*line.split("|", 2), "", ""])[:3]
        if name.strip() and partition.strip():
            default = partition.strip().endswith("*")
            nodes.append(NodeListing(name.strip(), partition.strip().rstrip("*"), default, state.strip()))
    return nodes


def idle_node_slots(nodes: list[NodeListing], partition: str | None, num_nodes: int) -> Slots:
    """Trials of ``num_nodes`` nodes each that the idle nodes of ``partition`` (sbatch's
    ``--partition``: one name or several, comma-separated; None: the default) run at once, at least 1.
    ``TunepodError`` when sinfo lists no such partition."""
    partitions = _partitions(nodes, partition)
    idle = {n.name for n in nodes if n.partition in partitions and n.state in IDLE_STATES}
    have = f"{counted(len(idle), 'idle node')} in partition {','.join(partitions)}"
    return divided(len(idle), have, num_nodes, "node")


def _partitions(nodes: list[NodeListing], partition: str | None) -> list[str]:
    known = sorted({n.partition + ("*" if n.default else "") for n in nodes})
    listed = ", ".join(known) or "none"
    if partition is None:
        default = sorted({n.partition for n in nodes if n.default})
        if not default:
            raise TunepodError(
                f"num_parallel auto: sinfo marks no default partition (partitions: {listed}); fix: set "
                "launcher.partition, or give num_parallel a number"
            )
        return default
    wanted = [name.strip() for name in partition.split(",") if name.strip()]
    missing = [name for name in wanted if name not in {n.partition for n in nodes}]
    if missing:
        raise TunepodError(
            f"num_parallel auto: sinfo lists no partition {', '.join(missing)} (partitions: {listed}); fix: "
            "set launcher.partition to one of them, or give num_parallel a number"
        )
    return wanted
