"""The chaos soak: a study of many short two-rank trials while a seeded driver injects real faults.

    .venv/bin/python -m benchmarks.chaos --launcher both --minutes 10 --nodes 2     # make chaos
    .venv/bin/python -m benchmarks.chaos --launcher local --trials 8 --seed 3 --minutes 2
    .venv/bin/python -m benchmarks.chaos --launcher slurm --nodes 2 --minutes 3   # node loss too

For each launcher it writes a spec (a stage step, then a tune step over
``tests/fixtures/trainers/collective.py``, which all-reduces over gloo, reports and checkpoints every
epoch and resumes from its latest checkpoint), starts a real ``mlflow server`` and ``tunepod run`` (each
in a session of its own), and while the study runs a seeded driver (``faults.py``) at random moments
SIGKILLs a job's process groups, one rank of a job, the orchestrator (then starts it again), the MLflow
server (then starts it again on the same port and store), and on Slurm runs ``scontrol requeue`` on a
running job. With ``--nodes 2`` each Slurm trial is one job over two namespaced nodes (partition
``nodes``), and the driver also loses a node under a trial (``scripts/slurm-node kill``, or ``scontrol``
sets it DOWN) and brings it back later, and before the soak ends whatever happens. At the end
``checks.py`` reads what is left (the Optuna journal, the MLflow server, the job dirs, ``/proc`` and
``squeue``) and the soak prints what it injected, which nodes went out and came back when, and what
held; exit 1 on any violation.

Modules: ``study.py`` (the spec, the processes the soak starts, what a job dir says), ``faults.py``
(the driver), ``nodes.py`` (the cluster's nodes: which a job holds, taking one out, bringing it back),
``checks.py`` (the invariants), ``soak.py`` (one launcher's soak), ``__main__.py`` (the command line
and the tables).
"""
