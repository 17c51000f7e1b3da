"""examples/tiny_llm through ``PipelineRun`` with real torchrun DDP jobs and real stores, on a tiny budget:
stage the stdlib corpus, tune two trials, evaluate on the test split, register. Resuming is the same
runtime contract as digits and is tested there."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from mlflow import MlflowClient

from tunepod.outputs import Dataset, Evaluation, Registration, StepOutput, TrialSet
from tunepod.pipeline import PipelineRun
from tunepod.staging.builtin import MANIFEST_FILE, write_python_stdlib

SPEC = "examples/tiny_llm/pipeline.yaml"
# Byte-level tokens: a model that guesses uniformly has perplexity 256.
UNIFORM_PERPLEXITY = 256.0


def test_python_stdlib_corpus_is_reproducible_and_split_90_5_5(tmp_path: Path) -> None:
    first = write_python_stdlib(tmp_path / "a")
    again = write_python_stdlib(tmp_path / "b")
    assert [p.name for p in first] == ["train.bin", "val.bin", "test.bin", MANIFEST_FILE]
    assert [hashlib.sha256(p.read_bytes()).digest() for p in first] == [
        hashlib.sha256(p.read_bytes()).digest() for p in again
    ]
    manifest = json.loads((tmp_path / "a" / MANIFEST_FILE).read_text())
    counts = manifest["counts"]
    sizes = {name: (tmp_path / "a" / f"{name}.bin").stat().st_size for name in ("train", "val", "test")}
    assert counts == sizes
    total = sum(counts.values())
    assert total > 200_000  # a few hundred KB: enough text that the model has something to learn
    assert 0.04 < counts["val"] / total < 0.06 and 0.04 < counts["test"] / total < 0.06
    assert b"# file: argparse.py\n" in (tmp_path / "a" / "train.bin").read_bytes()


def test_tiny_llm_pipeline_registers_a_model_better_than_uniform(
    in_repo: Path, isolated_overrides: list[str], tmp_path: Path
) -> None:
    overrides = [
        *isolated_overrides,
        f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log",
        "steps.search.with.num_trials=2",
        "steps.search.with.num_parallel=2",
        "steps.search.with.train.args.steps=30",
        "steps.search.with.train.args.eval_interval=15",
        "steps.check.with.top_k=1",
    ]
    run = PipelineRun.start(SPEC, overrides)
    outputs: dict[str, StepOutput] = {}
    for name in run.dag.order:
        outputs[name] = run.run_step(name, {need: outputs[need] for need in run.spec.steps[name].needs})
    run.finish(ok=True)

    corpus, search, check, promote = (outputs[name] for name in ("corpus", "search", "check", "promote"))
    assert isinstance(corpus, Dataset) and Path(corpus.path, "train.bin").is_file()
    assert isinstance(search, TrialSet) and len(search.trials) == 2
    best = search.best(1)[0]
    assert best.value is not None and math.isfinite(best.value)
    assert best.value < UNIFORM_PERPLEXITY
    assert isinstance(check, Evaluation) and check.metric == "test_perplexity"
    assert math.isfinite(check.best.value) and check.best.value < UNIFORM_PERPLEXITY
    assert isinstance(promote, Registration) and promote.alias_moved

    client = MlflowClient(run.tracker.tracking_uri)
    version = client.get_model_version_by_alias("tiny-gpt", "champion")
    assert str(version.version) == promote.version
    assert version.tags["tunepod.metric"] == "test_perplexity"
    assert float(version.tags["tunepod.value"]) == check.best.value
    trial_run = client.get_run(best.run_id or "")
    history = client.get_metric_history(trial_run.info.run_id, "val_perplexity")
    assert {15, 30} <= {m.step for m in history}  # one report per eval interval, mirrored into MLflow
