"""The soak's training script: two ranks over gloo, one all-reduce, report and checkpoint per epoch.

Params: x (float, tuned), epochs (int), sleep_s (float, pause per epoch). The score of epoch e is
``(1 - (mean x - 0.3)**2) * (e + 1) / epochs``. The checkpoint holds the epoch, x and the score, so a
start that resumes after the last epoch (killed between its last checkpoint and its result) finishes
with the score it had reached, not a fresh one. Every rank must join each epoch's all-reduce: a rank
killed mid-run leaves the other waiting until torchrun ends the job. Rank 0 appends a line to
<job dir>/starts.log at each start, ``<time before loading> <step of the checkpoint loaded, -1: none>``,
so a restart can be counted and the checkpoint it resumed from checked (``checks.resume_problems``).
"""

import time

import torch
import torch.distributed as dist

from tunepod import runtime

ctx = runtime.init({"x": 0.0, "epochs": 3, "sleep_s": 0.0})
dist.init_process_group("gloo")
x, epochs = float(ctx.params["x"]), int(ctx.params["epochs"])
started = time.time()
checkpoint = ctx.load_latest_checkpoint()
if ctx.is_main:
    with (ctx.checkpoint_dir.parent / "starts.log").open("a") as starts:
        starts.write(f"{started} {checkpoint.step if checkpoint else -1}\n")

score = float(checkpoint.state["score"]) if checkpoint else 0.0
for epoch in range(checkpoint.step + 1 if checkpoint else 0, epochs):
    total = torch.tensor([x])
    dist.all_reduce(total)
    score = (1.0 - (float(total) / ctx.world_size - 0.3) ** 2) * (epoch + 1) / epochs
    ctx.report(epoch, score=score)
    ctx.save_checkpoint({"epoch": epoch, "x": x, "score": score}, epoch)
    time.sleep(float(ctx.params["sleep_s"]))
ctx.finish(score=score)
dist.destroy_process_group()
