"""An LCBench trial as a training job: YAHPO Gym's surrogate answers each epoch, the job lives it.

Run it (from the repository root, with tunepod and onnxruntime importable: `make venv`):

    python examples/lcbench/train.py
    TUNEPOD_PARAMS='{"instance": "7593", "time_scale": 0.1}' python examples/lcbench/train.py

tunepod runs it as a trial (examples/lcbench/pipeline.yaml), on the surrogate's model and data
staged from benchmarks/lcbench/data (outside a job it reads them there). Each epoch it sleeps
``time_scale`` of the surrogate's training time for that epoch (what LCBench measured on its
hardware), then reports the surrogate's ``val_accuracy`` (percent) for it and checkpoints: the
same curve, the same stops, pauses and resumes as a real network's, for a fraction of its time and
no data. A stop (a prune, an ASHA pause, a requeue) that arrives during an epoch ends the job at
once: that epoch is not reported, and the job resumes after the last one it saved, as a real job
that lost its partial epoch.

Parameters: LCBench's 7 hyperparameters (``batch_size``, ``learning_rate``, ``momentum``,
``weight_decay``, ``num_layers``, ``max_units``, ``max_dropout``; defaults: config_space.json's),
``instance`` (an OpenML task id of LCBench's 34; default 3945), ``epochs`` (1-52; default 52) and
``time_scale`` (default 0.01). Any other parameter is an error. Epochs are numbered from 0:
step N reports epoch N + 1 of the surrogate's curve, as ``benchmarks/lcbench`` simulates it.
"""

import sys
import time
from pathlib import Path

from tunepod import runtime

# The surrogate ships with the benchmarks (its model and data), not with the tunepod package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.lcbench.surrogate import DATA_DIR, NUM_EPOCHS, Lcbench

DEFAULTS = {
    "batch_size": 91,
    "learning_rate": 0.0031622777,
    "momentum": 0.545,
    "weight_decay": 0.050005,
    "num_layers": 3,
    "max_units": 256,
    "max_dropout": 0.5,
    "instance": "3945",
    "epochs": NUM_EPOCHS,
    "time_scale": 0.01,
}
# How often a sleeping epoch looks for a stop: a stop lands within this, as it would between batches.
STOP_POLL_S = 0.05

ctx = runtime.init(DEFAULTS)
unknown = sorted(set(ctx.params) - set(DEFAULTS))
if unknown:
    raise SystemExit(f"unknown params {unknown}; valid params: {sorted(DEFAULTS)}")
params = ctx.params
epochs, time_scale = int(params["epochs"]), float(params["time_scale"])
if not 1 <= epochs <= NUM_EPOCHS:
    raise SystemExit(f"epochs must be 1-{NUM_EPOCHS} (LCBench's curves), got {epochs}")
if time_scale < 0:
    raise SystemExit(f"time_scale must be 0 or more, got {time_scale}")

data_dir = ctx.data_dir if ctx.source != "local" else DATA_DIR
if not (data_dir / "model.onnx").is_file():
    raise SystemExit(f"no model.onnx in {data_dir}; stage benchmarks/lcbench/data there first")
surrogate = Lcbench(data_dir)
config = {param.name: float(params[param.name]) for param in surrogate.space}
curves = surrogate.curve(str(params["instance"]), config)  # refuses an unknown instance, naming the valid
accuracy, elapsed_s = curves.val_accuracy[0].tolist(), curves.time[0].tolist()

start = 0
checkpoint = ctx.load_latest_checkpoint()
if checkpoint is not None:
    start = checkpoint.state["epoch"] + 1
    print(f"resuming from {checkpoint.path} at epoch {start}", flush=True)


def train_epoch(epoch: int) -> bool:
    """Sleep the epoch's scaled time; False when a stop came first."""
    seconds = time_scale * (elapsed_s[epoch] - (elapsed_s[epoch - 1] if epoch else 0.0))
    deadline = time.monotonic() + seconds
    while not ctx.should_stop():
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        ctx.heartbeat(epoch)
        time.sleep(min(left, STOP_POLL_S))
    return False


for epoch in range(start, epochs):
    if not train_epoch(epoch):
        raise SystemExit(0)  # stopped mid-epoch: the last saved epoch is where the next job resumes
    ctx.report(epoch, val_accuracy=accuracy[epoch])
    ctx.save_checkpoint({"epoch": epoch, "config": config, "instance": str(params["instance"])}, epoch)

ctx.finish(val_accuracy=accuracy[epochs - 1])
