# Everything a fresh machine needs: `make demo` runs the digits pipeline, `make test` the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SPEC ?= examples/digits/pipeline.yaml
# Three pytest workers on two cores: with two, the cores were idle a third of the time (tests wait on
# servers, subprocesses and injected outages); three took the suite from 27.6-30.9 to 24.2 minutes here
# (2026-12-03). Groups are handed out longest first (tests/conftest.py).
TEST_WORKERS ?= 3

.PHONY: venv demo test lint services bench bench-overhead bench-checkpoints bench-node-loss chaos simulate \
	mutate clean slurm-up slurm-down postgres-up postgres-down

# torch==2.13.0 first, with pip: it is the CPU build (pip finds it on this kind of machine's disk); a
# bare `torch` requirement could pull a multi-GB CUDA build. The rest with uv, which installs the same
# requirements in seconds where pip takes minutes, and keeps the torch already there.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0 uv
	$(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/tunepod run $(SPEC)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The slurm-marked tests need the local one-node Slurm cluster (and, over ssh, an sshd on 127.0.0.1:2222),
# the metrics test Debian's prometheus, the UI tests Debian's chromium, the stack and production-store
# tests Debian's PostgreSQL (root: the scripts install Debian packages when missing). Without them those tests skip with the reason,
# except under CI=true where they fail. Lint runs beside the services' start (mypy alone takes a
# minute on a fresh clone; the scripts mostly wait on Debian's installs).
test: venv
	$(MAKE) --no-print-directory -j2 lint services
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=30

services:
	scripts/slurm-up || echo "warning: no local Slurm cluster; the slurm tests will skip (fail under CI=true)" >&2
	scripts/prometheus-up || echo "warning: no prometheus; its test will skip (fail under CI=true)" >&2
	scripts/browser-up || echo "warning: no chromium; the UI tests will skip (fail under CI=true)" >&2
	scripts/sshd-up || echo "warning: no test sshd; the slurm-over-ssh tests will skip (fail under CI=true)" >&2
	scripts/postgres-up || echo "warning: no PostgreSQL; the production-store tests will skip (fail under CI=true)" >&2

# The local Slurm cluster the slurm-marked tests use: this host (partition debug) and NODES namespaced
# nodes (partition nodes; default 4, what the tests need). Root; installs Debian packages if missing.
slurm-up:
	scripts/slurm-up $(if $(NODES),--nodes $(NODES))

slurm-down:
	scripts/slurm-down

# A PostgreSQL on 127.0.0.1:5433 for trying the stack on production stores (README "Production stores").
postgres-up:
	scripts/postgres-up

postgres-down:
	scripts/postgres-down

# Every benchmark side by side with its baseline, short forms (under 15 minutes on 2 cores); the long
# forms: make bench BENCH_ARGS=--long; a subset: make bench BENCH_ARGS="--only scale,staging".
bench: venv
	$(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[dev,bench]'
	$(PY) -m benchmarks $(BENCH_ARGS)

bench-overhead: venv
	$(PY) benchmarks/overhead.py

# Checkpoint stall, kill -> resume and write throughput against torch.save, torch.load, dd and cp
# (benchmarks/checkpoints); the long form (~1 GB states): make bench-checkpoints CHECKPOINT_ARGS=--long
bench-checkpoints: venv
	$(PY) -m benchmarks.checkpoints $(CHECKPOINT_ARGS)

# A node's death to the trial's next trained step on the local cluster's namespaced nodes, part by part,
# against a planned requeue, and the "node-loss recovery" line: restore from a peer's memory, from the shared
# file system, elastic continue (benchmarks/node_loss; root: it kills nodes). Long form: NODE_LOSS_ARGS=--long;
# the line alone: NODE_LOSS_ARGS=--only=peer-memory,shared,elastic
bench-node-loss: venv
	scripts/slurm-up
	$(PY) -m benchmarks.node_loss $(NODE_LOSS_ARGS)

# The chaos soak (benchmarks/chaos): real faults at random on local and Slurm studies, then the checks;
# exit 1 on a violation. The Slurm trials span two of slurm-up's namespaced nodes (--nodes 2), so nodes
# are lost too. Without Slurm: make chaos CHAOS_ARGS="--launcher local".
CHAOS_ARGS ?= --launcher both --minutes 10 --seed 1 --nodes 2
chaos: venv
	scripts/slurm-up || echo "warning: no local Slurm cluster; run with CHAOS_ARGS='--launcher local'" >&2
	$(PY) -m benchmarks.chaos $(CHAOS_ARGS)

# The deterministic simulation of the tuning loop (tests/simulation): the real tuner, drivers, leases,
# outbox and mirrors (and, in some seeds, the train and evaluate steps' run_job) over simulated time
# (every call lasting a duration drawn from the seed), processes, backends and stores, faults at every
# boundary and at any yield point, the invariants checked after every step. SEEDS seeds on two
# processes (prints "seeds: N, violations: K");
# one seed with its trace and a replay: make simulate SEED=42 (SIMULATE_ARGS=--shrink: the fewest
# faults that still break it); every fixed defect put back, each to be found: SIMULATE_ARGS=--mutants.
SEEDS ?= 1000
simulate: venv
	PYTHONPATH=tests PYTHONHASHSEED=0 $(PY) -m simulation $(if $(SEED),--seed $(SEED),--seeds $(SEEDS)) $(SIMULATE_ARGS)

# Mutation testing of the tuning loop's library code (tests/mutation): each mutant of its catalog, a
# small bug written without reading the simulation, is put into a copy of tunepod/ and the simulation
# runs on that copy, one mutant at a time, until its first violating seed (at most MUTATE_SEEDS).
# Prints each verdict, the mutation score and the survivors; exit 1 on a survivor without a reason
# written. Some of them: make mutate MUTANTS=drive-restart-off-by-one,base-marker-after-stop
MUTATE_SEEDS ?= 1000
mutate: venv
	PYTHONPATH=tests PYTHONHASHSEED=0 $(PY) -m mutation --seeds $(MUTATE_SEEDS) $(if $(MUTANTS),--mutants $(MUTANTS)) $(MUTATE_ARGS)

clean:
	rm -rf .tunepod
