"""tunepod's side of the staging benchmark, as a process of its own like the CLIs it is measured against:
``python -m benchmarks.staging.tunepod_side SOURCE TARGET`` calls ``tunepod.staging.stage`` (what a
pipeline's stage step calls) and prints its ``StageReport`` as JSON."""

from __future__ import annotations

import sys
from pathlib import Path

from tunepod.staging import stage


def main(argv: list[str]) -> int:
    source, target = argv
    report = stage(source, Path(target), Path(target).parent / ".tunepod-cache")
    print(report.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
