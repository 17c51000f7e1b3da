"""The baseline: a bare FastAPI app whose one POST route answers 202 and does nothing.

    python -m benchmarks.webhook.baseline --port 8788

Served by ``uvicorn.run`` with exactly the arguments ``tunepod webhook serve`` passes it (one worker,
uvicorn's default loop and HTTP implementation, log level info and so its access log), so that the
only difference between the two servers is what the route does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastapi import FastAPI, Response

app = FastAPI(title="bare endpoint")


@app.post("/hooks/{hook}", status_code=202)
async def receive(hook: str) -> Response:
    return Response(status_code=202)


def main(argv: Sequence[str]) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m benchmarks.webhook.baseline", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main(sys.argv[1:])
