"""examples/tiny_llm under FSDP2 and FSDP2 x TP on 4 gloo CPU processes: train, checkpoint (sharded,
async), SIGKILL the job's process group, resume, and land on the uninterrupted run's loss curve; a
pipeline-parallel run (2 stages x FSDP2 over 2 data ranks) trains and checkpoints; evaluate_llm.py
scores a sharded checkpoint.

The jobs run the real training script under the runtime contract (the env of test_digits_example's
``Job``, plus ``TUNEPOD_PARALLELISM`` and what torchrun sets: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``PORT``), but the ranks are forked from this process, where torch, DTensor and
torch._dynamo are imported once, instead of started by torchrun. Measured on 2 cores: a 12-step job
under torchrun took 26-40 s, most of it 4 fresh interpreters importing torch and torch._dynamo
(DTensor's first use imports it) and tearing them down; forked, 5-17 s. This module runs 7 such jobs.
Like torchrun's, each job here is an agent, the leader of a session of its own, that starts the
ranks, kills the others when one fails and exits with the first failure; the test SIGKILLs the
whole session with ``os.killpg``, as a launcher kills torchrun.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import re
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from ports import free_port
from test_digits_example import Job, new_job

from tunepod import runtime
from tunepod.runtime import Parallelism
from tunepod.staging.builtin import write_python_stdlib

torch = pytest.importorskip("torch")
# Imported here, once, so that each forked rank finds them loaded (see the module docstring).
pytest.importorskip("torch._dynamo")
pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("torch.distributed.tensor.parallel")
pytest.importorskip("torch.distributed.checkpoint.state_dict")
pytest.importorskip("torch.distributed.pipelining")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_llm"
TRAIN = EXAMPLE / "train_llm.py"
EVALUATE = EXAMPLE / "evaluate_llm.py"
PROCS = 4
STEPS, EVAL_INTERVAL = 12, 4
PARAMS = {
    "d_model": 32,
    "n_layer": 2,
    "n_head": 4,
    "context": 32,
    "batch_size": 4,
    "steps": STEPS,
    "eval_interval": EVAL_INTERVAL,
    "warmup_steps": 4,
    "seed": 0,
}
LAYOUTS = {
    "fsdp2": Parallelism(data=4, sharding="full", shard=4),
    "fsdp2_x_tp": Parallelism(data=2, tensor=2, sharding="full", shard=2),
}
# A guard against a hung job (a rank stuck in a collective), not a speed expectation.
JOB_DEADLINE_S = 120


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    write_python_stdlib(folder)
    return folder


def _rank_main(script: Path, env: dict[str, str], rank: int) -> None:
    """One rank, in a forked process: the script as ``__main__`` with torchrun's environment."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
        sys.path.insert(0, str(script.parent))
        sys.argv = [str(script)]
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: the parent's modules are not this process's to free


def _agent(script: Path, env: dict[str, str], procs: int, log: Path) -> None:
    """What torchrun's agent does, in its own session: start the ranks, wait, kill the rest at the
    first failure, exit with it."""
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    ranks = []
    for rank in range(procs):
        pid = os.fork()
        if pid == 0:
            _rank_main(script, env, rank)
        ranks.append(pid)
    failure = 0
    while ranks:
        pid, status = os.wait()
        ranks.remove(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not failure:
            failure = code if code > 0 else 128 - code
            print(f"agent: rank pid {pid} exited {code}; killing the others", flush=True)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    os._exit(failure)


class Launch:
    """A job of ``procs`` forked ranks, started by a forked agent (the leader of its own session)."""

    def __init__(
        self,
        job: Job,
        data_dir: Path,
        params: dict[str, Any],
        layout: Parallelism | None,
        script: Path = TRAIN,
        procs: int = PROCS,
    ) -> None:
        env = job.env(data_dir, params)
        env.update(
            WORLD_SIZE=str(procs),
            LOCAL_WORLD_SIZE=str(procs),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
        if layout is not None:
            env[runtime.PARALLELISM_ENV] = layout.to_json()
        self.job = job
        self.process = multiprocessing.get_context("fork").Process(
            target=_agent, args=(script, env, procs, job.log)
        )
        self.process.start()

    def wait_ok(self) -> None:
        self.process.join(JOB_DEADLINE_S)
        if self.process.exitcode is None:
            self.kill()
        assert self.process.exitcode == 0, (
            f"exit {self.process.exitcode}; {self.job.log}:\n{self.job.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the whole session (agent and ranks) and wait until none of its processes runs."""
        pid = self.process.pid
        assert pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        self.process.join()
        deadline = time.monotonic() + 30
        while _running_in_group(pid):
            # The orphaned ranks stay zombies until init reaps them (a second or more here), but a
            # zombie has already let go of its files and sockets: dead enough to resume after.
            assert time.monotonic() < deadline, f"processes of group {pid} survived SIGKILL"
            time.sleep(0.02)


def _running_in_group(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is alive and not a zombie (from /proc/<pid>/stat)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            state, _, group = stat.read_text().rpartition(")")[2].split()[:3]
            if int(group) == pgid and state != "Z":
                return True
    return False


def _committed_steps(job: Job) -> list[int]:
    return sorted(info.step for info in runtime.valid_checkpoints(job.checkpoint_dir))


def _curve(job: Job) -> dict[int, dict[str, float]]:
    """Each report's losses; tokens_per_s (a timing, different in every run) only checked positive."""
    curve = {}
    for report in job.reports():
        metrics = dict(report.metrics)
        assert metrics.pop("tokens_per_s") > 0, report
        curve[report.step] = metrics
    return curve


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_killed_sharded_run_resumes_on_the_uninterrupted_loss_curve(
    layout: str, corpus: Path, tmp_path: Path
) -> None:
    whole = new_job(tmp_path / "whole")
    Launch(whole, corpus, PARAMS, LAYOUTS[layout]).wait_ok()
    expected = _curve(whole)
    assert sorted(expected) == [4, 8, 12]
    assert expected[12]["train_loss"] < expected[4]["train_loss"]  # it learns
    assert _committed_steps(whole) == [4, 8, 12]  # the last one committed by finish at the latest
    metadata = json.loads((whole.checkpoint_dir / "step-000012" / "metadata.json").read_text())
    assert metadata["format"] == "dcp"
    assert {f"__{rank}_0.distcp" for rank in range(PROCS)} <= set(metadata["files"])  # a shard per rank

    # The same job in a fresh folder, SIGKILLed once a step is committed (in the background, once
    # every shard is written) and before the end: mid-way through the next steps, or while the
    # next step's save is written (its hidden folder is ignored). It resumes from the newest one.
    killed = new_job(tmp_path / "killed")
    launch = Launch(killed, corpus, PARAMS, LAYOUTS[layout])
    deadline = time.monotonic() + JOB_DEADLINE_S
    # A committed step is a step-N folder (renamed into place whole); its checksums are checked below.
    while launch.process.is_alive() and time.monotonic() < deadline:
        if any(killed.checkpoint_dir.glob("step-*")):
            break
        time.sleep(0.01)
    launch.kill()
    committed = _committed_steps(killed)
    assert committed and not killed.result.exists(), f"the run ended before the kill:\n{killed.log_tail()}"
    resumed_from = committed[-1]
    assert resumed_from < STEPS

    resumed = new_job(tmp_path / "resumed", checkpoint_dir=killed.checkpoint_dir)
    Launch(resumed, corpus, PARAMS, LAYOUTS[layout]).wait_ok()
    log = resumed.log.read_text()
    assert re.search(rf"resuming from \S+step-{resumed_from:06d} at step {resumed_from}\n", log), log
    curve = _curve(resumed)
    # It started at the committed step, not at 0: its first report is the first one after it.
    assert sorted(curve) == [step for step in expected if step > resumed_from]
    # Same layout, seed and batches (a function of seed, step and data rank), weights and AdamW
    # moments restored exactly, every collective reducing in the same order: the resumed run computes
    # bit for bit what the uninterrupted one did, so no tolerance. (Measured: equal to the last bit in
    # every run so far. Anything a resume gets wrong, a batch drawn twice, the optimizer's step count,
    # a learning rate one step off, moves these values by 1e-4 or more, so a tolerance of, say,
    # rel 1e-6 would catch the same bugs, should a torch version ever reorder a reduction.)
    for step, metrics in curve.items():
        assert metrics == expected[step], step
    for step, metrics in _curve(killed).items():  # what the killed run reported before it died
        assert metrics == expected[step], step
    assert json.loads(resumed.result.read_text())["metrics"] == {
        "val_perplexity": expected[STEPS]["val_perplexity"]
    }
    if LAYOUTS[layout].tensor > 1:
        # The evaluate step scores the winning checkpoint in one process, the shards read whole (the
        # DTensors of both meshes, the tied embedding); FSDP2 alone adds nothing to that.
        _evaluate(whole, corpus)


def _evaluate(trained: Job, corpus: Path) -> None:
    scored = new_job(
        trained.root.parent / f"{trained.root.name}-evaluate", checkpoint_dir=trained.checkpoint_dir
    )
    Launch(scored, corpus, {}, None, script=EVALUATE, procs=1).wait_ok()
    assert re.search(r"step-\d{6}: test_perplexity", scored.log.read_text()), scored.log_tail()
    test_perplexity = json.loads(scored.result.read_text())["metrics"]["test_perplexity"]
    assert math.isfinite(test_perplexity) and test_perplexity < 256  # better than guessing bytes uniformly


def test_pipeline_stages_split_the_model_and_compose_to_it() -> None:
    sys.path.insert(0, str(EXAMPLE))
    try:
        from tiny_gpt import TinyGPT, pipeline_stage
    finally:
        sys.path.remove(str(EXAMPLE))
    config = {"vocab_size": 256, "context": 32, "n_layer": 3, "n_head": 4, "d_model": 32, "dropout": 0.0}

    def built() -> Any:
        torch.manual_seed(0)  # every stage builds the whole model alike, then keeps its part
        return TinyGPT(**config, tied=False)

    whole = built()
    stages = [pipeline_stage(built(), stage, 2) for stage in range(2)]
    names = [set(stage.state_dict()) for stage in stages]
    assert not names[0] & names[1] and names[0] | names[1] == set(whole.state_dict())  # own keys each
    assert {name.split(".")[1] for name in names[0] if name.startswith("blocks.")} == {"0"}
    assert {name.split(".")[1] for name in names[1] if name.startswith("blocks.")} == {"1", "2"}
    assert "token_embedding.weight" in names[0] and "head.weight" in names[1]
    tokens = torch.randint(0, 256, (2, 32))
    assert torch.equal(stages[1](stages[0](tokens)), whole(tokens))
    with pytest.raises(ValueError, match="tied=False"):
        pipeline_stage(TinyGPT(**config), 0, 2)  # a tied model cannot put its two ends on two ranks


def test_a_pipeline_of_two_fsdp2_stages_trains_and_checkpoints(corpus: Path, tmp_path: Path) -> None:
    """pipeline 2 x data 2 (FSDP2 within each stage), GPipe over 2 micro-batches: gloo on the CPU runs
    the stages' point-to-point sends as well as FSDP2's collectives."""
    job = new_job(tmp_path / "pipeline")
    layout = Parallelism(data=2, pipeline=2, sharding="full", shard=2)
    Launch(job, corpus, {**PARAMS, "steps": 8}, layout).wait_ok()
    curve = _curve(job)
    assert sorted(curve) == [4, 8]
    assert curve[8]["train_loss"] < curve[4]["train_loss"] < math.log(256) + 0.5
    assert curve[8]["val_perplexity"] < 256
    metadata = json.loads((job.checkpoint_dir / "step-000008" / "metadata.json").read_text())
    assert {f"__{rank}_0.distcp" for rank in range(PROCS)} <= set(metadata["files"])
    _evaluate(job, corpus)  # the stages' shards make one untied model again


OTHER_LAYOUTS = {
    # Tensor parallelism without FSDP2: the blocks' weights are DTensors, the norms and embeddings
    # plain tensors, and the data ranks' gradients are averaged by hand.
    "tp_without_fsdp": Parallelism(data=2, tensor=2),
    "hsdp": Parallelism(data=4, sharding="hybrid", shard=2),
    "pipeline_x_tp": Parallelism(data=1, tensor=2, pipeline=2),
}


@pytest.mark.parametrize("layout", OTHER_LAYOUTS)
def test_the_other_layouts_train_and_checkpoint(layout: str, corpus: Path, tmp_path: Path) -> None:
    """Each layout the search space of pipeline-layouts.yaml can draw, beyond those above, trains a few
    steps on 4 processes (a finite loss near uniform guessing or below) and commits sharded steps."""
    job = new_job(tmp_path / layout)
    Launch(job, corpus, {**PARAMS, "steps": 4, "eval_interval": 2}, OTHER_LAYOUTS[layout]).wait_ok()
    curve = _curve(job)
    assert sorted(curve) == [2, 4]
    assert curve[4]["train_loss"] < math.log(256) + 0.5
    assert _committed_steps(job) == [2, 4]
