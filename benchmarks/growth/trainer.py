"""The growth benchmark's training job: reports ``reports`` steps through the training contract, fast.

Params: ``reports`` (steps to report, 0 .. reports-1), ``rate`` (reports per second, paced in bursts
of ``burst_s``, so the orchestrator sees the same stream in every tenth of the run), ``state_mb``
(a checkpoint of that many MB is saved at every tenth; 0: none), ``variant`` (the searched param:
a single choice, so every trial is the same job). Reports ``score`` = 1.0 at every step, above the
study's completed trial (which the benchmark records at 0.0), so the pruner is asked and never prunes.
No training happens: what is measured is the orchestrator's work per report.
"""

from __future__ import annotations

import time

from tunepod import runtime

ctx = runtime.init({"reports": 100_000, "rate": 1500.0, "burst_s": 0.1, "state_mb": 1.0, "variant": 0})
reports = int(ctx.params["reports"])
burst = max(1, round(float(ctx.params["rate"]) * float(ctx.params["burst_s"])))
state = bytes(int(float(ctx.params["state_mb"]) * 1e6))
checkpoint_every = max(1, reports // 10)
started = time.monotonic()
for step in range(reports):
    ctx.report(step, score=1.0)
    if state and (step + 1) % checkpoint_every == 0:
        ctx.save_checkpoint(state, step)
    if (step + 1) % burst == 0:
        # Paced against the start, not the last burst: a slow burst does not slow the whole run down.
        ahead_s = (step + 1) / float(ctx.params["rate"]) - (time.monotonic() - started)
        if ahead_s > 0:
            time.sleep(ahead_s)
ctx.finish(score=1.0)
