"""torchrun's arguments for an elastic job (``resources.min_nodes`` below ``num_nodes``), shared by the
launchers that run one (Slurm, Kubeflow on EKS) and by the tests that stand agents in for nodes.

torch's own elastic agent does the re-forming: ``--nnodes=min:max`` with a c10d rendezvous lets the
agents of the surviving nodes form a new group when a node's worker dies (its peers' collectives fail,
so do they, and every agent restarts its workers into the next rendezvous round), and
``--max-restarts`` bounds how often that may happen. The training contract tells the new workers
that the world changed (``TrainingContext.world_change``).
"""

from __future__ import annotations

from tunepod.spec.resources import Resources

RDZV_LAST_CALL_S = 5
"""Once ``min_nodes`` agents joined a round, how long it waits for more before it starts: at start-up
the agents of one job arrive within a second or two; after a node loss the survivors wait this long
for nodes that will not come."""
RDZV_KEEP_ALIVE_S = 2
RDZV_KEEP_ALIVE_MAX_ATTEMPTS = 3
"""A node whose agent missed this many keep-alives (2 s apart) counts as gone, and the next round
forms without it: 6 s instead of torch's 15 s default, which a re-forming group would wait."""


def rdzv_conf() -> str:
    """``--rdzv-conf`` of an elastic job: the timings above."""
    return (
        f"last_call_timeout={RDZV_LAST_CALL_S},keep_alive_interval={RDZV_KEEP_ALIVE_S},"
        f"keep_alive_max_attempt={RDZV_KEEP_ALIVE_MAX_ATTEMPTS}"
    )


def torchrun_elastic_args(resources: Resources) -> list[str]:
    """``--nnodes=min:max``, ``--max-restarts`` and ``--rdzv-conf`` for an elastic job; ``[]`` else."""
    if not resources.elastic:
        return []
    return [
        f"--nnodes={resources.nnodes}",
        f"--max-restarts={resources.elastic_restarts}",
        f"--rdzv-conf={rdzv_conf()}",
    ]
