"""Ray Tune on the scale benchmark's trivial trials (run as a process of its own by ``__main__``).

    python -m benchmarks.scale.ray_side OUT_JSON --trials N --parallel P --sleep-s S --reports R --storage DIR
        [--fresh-actors]

Random search (Ray's default ``BasicVariantGenerator``), no scheduler, ``max_concurrent_trials=P``,
on a local Ray started with ``num_cpus=P`` (one logical CPU per trial, so P run at once on any
machine), dashboard off. Each trial is the function trainable below: the same sleep and reports as
``trainer.py``. ``reuse_actors=True`` (Ray's fastest setting for many short trials: a worker process
runs trial after trial; Ray's default, a new actor process per trial, with ``--fresh-actors``).
Writes how many trials terminated and how many errored.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def trivial(config: dict[str, Any]) -> None:
    from ray import tune

    reports = int(config["reports"])
    score = 1.0 - (float(config["x"]) - 0.3) ** 2
    for step in range(reports):
        time.sleep(float(config["sleep_s"]) / reports)
        tune.report({"score": score * (step + 1) / reports, "step": step})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--trials", type=int, required=True)
    parser.add_argument("--parallel", type=int, required=True)
    parser.add_argument("--sleep-s", type=float, required=True)
    parser.add_argument("--reports", type=int, required=True)
    parser.add_argument("--storage", type=Path, required=True)
    parser.add_argument("--fresh-actors", action="store_true", help="Ray's default: an actor per trial")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import tune

    ray.init(num_cpus=args.parallel, include_dashboard=False, log_to_driver=False)
    tuner = tune.Tuner(
        trivial,
        param_space={"x": tune.uniform(0.0, 1.0), "sleep_s": args.sleep_s, "reports": args.reports},
        tune_config=tune.TuneConfig(
            num_samples=args.trials,
            max_concurrent_trials=args.parallel,
            metric="score",
            mode="max",
            reuse_actors=not args.fresh_actors,
        ),
        run_config=tune.RunConfig(storage_path=str(args.storage.resolve()), name="scale", verbose=0),
    )
    results = tuner.fit()
    errored = sum(1 for result in results if result.error is not None)
    args.out.write_text(json.dumps({"trials": len(results), "errored": errored}))
    ray.shutdown()


if __name__ == "__main__":
    main()
