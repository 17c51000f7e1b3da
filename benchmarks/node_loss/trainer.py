"""The node-loss benchmark's training script: one rank per node over gloo, an all-reduce and a report
per step, a checkpoint of ``state_mb`` MB each step.

Params: steps (int), sleep_s (float, pause per step), state_mb (float, the checkpoint's tensor). Rank 0
appends ``<started> <loaded> <step loaded, -1: none>`` to <job dir>/starts.log at each start: when the
process group had formed, and when the checkpoint was loaded, so the benchmark can split a restart.
"""

import time

import torch
import torch.distributed as dist

from tunepod import runtime

ctx = runtime.init({"steps": 20, "sleep_s": 1.0, "state_mb": 64.0})
dist.init_process_group("gloo")
started = time.time()
checkpoint = ctx.load_latest_checkpoint()
loaded = time.time()
if ctx.is_main:
    with (ctx.checkpoint_dir.parent / "starts.log").open("a") as starts:
        starts.write(f"{started} {loaded} {checkpoint.step if checkpoint else -1}\n")
weights = torch.zeros(int(float(ctx.params["state_mb"]) * 2**20 / 4))
for step in range(checkpoint.step + 1 if checkpoint else 0, int(ctx.params["steps"])):
    total = torch.ones(1)
    dist.all_reduce(total)
    ctx.report(step, loss=1.0 / (step + 1))
    ctx.save_checkpoint({"weights": weights, "step": step}, step)
    time.sleep(float(ctx.params["sleep_s"]))
ctx.finish(loss=1.0)
dist.destroy_process_group()
