"""Each instance's reference values for normalized regret, from a large random sample; cached in JSON.

    .venv/bin/python -m benchmarks.lcbench.reference            # all 34 instances (~15 min here)
    .venv/bin/python -m benchmarks.lcbench.reference --instances 3945,7593 --configs 2000

For each instance, ``--configs`` configurations (20,000) drawn uniformly from the space with
``--seed`` (0), the same draws for every instance, each queried at all 52 epochs. Stored per
instance: ``best`` (the highest val_accuracy at any epoch of any draw: an arm's incumbent is the
best value seen at any epoch, so the reference best must be taken the same way), ``best_final`` (at
epoch 52 alone), ``worst_final`` (the lowest at epoch 52: what a bad full-length trial gives) and
``median_final``. Normalized regret is ``(best - incumbent) / (best - worst_final)`` (metrics.py).
Written to ``data/reference.json`` (committed), merged with what is there, so runs never recompute it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.lcbench.surrogate import DATA_DIR, NUM_EPOCHS, Lcbench

REFERENCE_PATH = DATA_DIR / "reference.json"
NUM_CONFIGS = 20_000
SEED = 0
# Rows per ONNX call: 1,000 curves x 52 epochs is ~200 MB of intermediate tensors at most.
CHUNK = 1_000


def reference_of(lcbench: Lcbench, instance: str, configs: Sequence[dict[str, float]]) -> dict[str, float]:
    """The reference values of one instance over ``configs`` (see the module's docstring)."""
    chunks = [
        lcbench.curves(instance, configs[start : start + CHUNK]).val_accuracy
        for start in range(0, len(configs), CHUNK)
    ]
    accuracy = np.concatenate(chunks)
    final = accuracy[:, NUM_EPOCHS - 1]
    return {
        "best": float(accuracy.max()),
        "best_final": float(final.max()),
        "worst_final": float(final.min()),
        "median_final": float(np.median(final)),
    }


def load_references(path: Path = REFERENCE_PATH) -> dict[str, dict[str, float]]:
    """Every cached instance's reference values, by instance id."""
    if not path.exists():
        return {}
    return dict(json.loads(path.read_text())["instances"])


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lcbench.reference", description=__doc__)
    parser.add_argument("--instances", type=lambda text: text.split(","), help="comma-separated (all 34)")
    parser.add_argument("--configs", type=int, default=NUM_CONFIGS, help=f"draws ({NUM_CONFIGS})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the draws' seed ({SEED})")
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH, help="the JSON to write (merged)")
    args = parser.parse_args(argv)
    lcbench = Lcbench(num_threads=2)
    configs = lcbench.sample(np.random.default_rng(args.seed), args.configs)
    references = load_references(args.out)
    for instance in args.instances or lcbench.instances:
        references[instance] = reference_of(lcbench, instance, configs) | {
            "num_configs": args.configs,
            "seed": args.seed,
        }
        print(instance, references[instance], flush=True)
        document = {
            "how": "num_configs configurations drawn uniformly (seed), all 52 epochs of each: "
            "benchmarks/lcbench/reference.py",
            "instances": dict(sorted(references.items(), key=lambda item: lcbench.instances.index(item[0]))),
        }
        # Through a temp file, so that an interrupted run leaves the previous JSON whole.
        temp = args.out.with_suffix(".tmp")
        temp.write_text(json.dumps(document, indent=1) + "\n")
        temp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
