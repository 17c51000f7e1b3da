"""The trivial trial of the scale benchmark: sleep, report a few values, finish (stdlib + tunepod.runtime).

Params: x (float), sleep_s (float), reports (int): ``reports`` values spread over ``sleep_s`` seconds.
"""

import time

from tunepod import runtime

ctx = runtime.init({"x": 0.0, "sleep_s": 1.0, "reports": 3})
reports = int(ctx.params["reports"])
score = 1.0 - (float(ctx.params["x"]) - 0.3) ** 2
for step in range(reports):
    time.sleep(float(ctx.params["sleep_s"]) / reports)
    ctx.report(step, score=score * (step + 1) / reports)
ctx.finish(score=score)
