"""The namespaced nodes of the local Slurm cluster (``scripts/slurm-up --nodes N``, partition ``nodes``)
as the soak sees them: which nodes a job holds, which jobs a node runs, and the three ways the soak
takes a node out and brings it back.

- a power cut: ``scripts/slurm-node kill NODE`` SIGKILLs every process in the node's namespaces
  (slurmd, job steps, trainers); the controller marks it DOWN after ``SlurmdTimeout`` and requeues its
  jobs. ``scripts/slurm-node start NODE`` starts its slurmd again and the node returns to service.
- the controller's side: ``scontrol update nodename=NODE state=drain``, then ``state=down``: slurmd
  kills the node's job steps at once and the controller requeues its jobs; ``state=resume`` returns the
  node. The drain comes first because with ``ReturnToService=2`` a DOWN node whose slurmd answers is
  back in service within a ping (tenths of a second); the drain flag outlives that and keeps it out.
- a network partition: ``scripts/slurm-node cut NODE`` sets its link down; its processes live on,
  unreachable, the controller marks it DOWN as for a power cut; ``mend`` sets the link up, and the
  node's slurmd, told to register again, kills what was left of the requeued jobs there.

Every command here runs as root (the soak does, as the rest of the cluster's scripts).
"""

from __future__ import annotations

import subprocess

from benchmarks.chaos.study import NODE_PARTITION, REPO

SLURM_NODE = REPO / "scripts" / "slurm-node"
#: States in which a node serves jobs (idle, or busy with someone's).
IN_SERVICE = frozenset({"idle", "mixed", "allocated", "completing"})
#: The reason ``scontrol update ... state=down`` records (``sinfo -R`` shows it).
DOWN_REASON = "chaos soak"


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def job_nodes(job_id: str) -> list[str]:
    """The nodes a job holds now (none while it is pending or gone)."""
    listed = _run(["squeue", "-h", "-j", job_id, "-o", "%N"]).stdout.strip()
    if not listed or listed == "(null)":
        return []
    return _run(["scontrol", "show", "hostnames", listed]).stdout.split()


def jobs_on(node: str) -> list[str]:
    """The ids of every job on ``node`` now, whoever sent it."""
    return _run(["squeue", "-h", "-w", node, "-o", "%i"]).stdout.split()


def node_states(partition: str = NODE_PARTITION) -> dict[str, str]:
    """Each node of ``partition`` and its state as ``sinfo`` names it (``idle``, ``down*``, ...)."""
    listed = _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %T"]).stdout
    return dict(line.split() for line in listed.splitlines() if len(line.split()) == 2)


def in_service(state: str) -> bool:
    """Whether a node in ``state`` takes jobs (a trailing ``*``, not responding, does not)."""
    return state in IN_SERVICE


def kill(node: str) -> str:
    """A power cut of ``node``; '' when it was made, else why not."""
    return _failure(_run([str(SLURM_NODE), "kill", node], timeout=60))


def start(node: str) -> str:
    """Start the slurmd of a killed ``node`` again; '' when it runs, else why not."""
    return _failure(_run([str(SLURM_NODE), "start", node], timeout=60))


def cut(node: str) -> str:
    """``node``'s link set down: its processes live on, unreachable; '' when it was, else why not."""
    return _failure(_run([str(SLURM_NODE), "cut", node], timeout=60))


def mend(node: str) -> str:
    """``node``'s link up again, and the node back in service; '' or why not."""
    return _failure(_run([str(SLURM_NODE), "mend", node], timeout=60))


def set_down(node: str) -> str:
    """The controller takes ``node`` out (drained, its jobs' steps killed, the jobs requeued); '' when it
    did, else why not."""
    for state in ("drain", "down"):
        if failed := _failure(
            _run(["scontrol", "update", f"nodename={node}", f"state={state}", f"reason={DOWN_REASON}"])
        ):
            return failed
    return ""


def resume(node: str) -> str:
    """The controller returns ``node`` to service; '' or why not."""
    return _failure(_run(["scontrol", "update", f"nodename={node}", "state=resume"]))


def _failure(done: subprocess.CompletedProcess[str]) -> str:
    if done.returncode == 0:
        return ""
    return f"{' '.join(done.args)}: exit {done.returncode}: {(done.stderr or done.stdout).strip()}"
