"""The staging benchmark's short form (``python -m benchmarks.staging`` runs the real one): its S3 table on a
tiny data set, the AWS CLI as the baseline, one full copy each (``--no-restage``: each AWS CLI run costs
seconds of start-up alone, and the CI budget is tight).

Proves: the benchmark runs end to end against its own moto server; tunepod's S3 stage makes the very
tree ``aws s3 sync`` makes of the same bucket, byte for byte, and both are the source's. Speed is never
asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("boto3")

REPO = Path(__file__).resolve().parents[2]
AWS = Path(sys.executable).parent / "aws"
#: Against a hang only, never a speed check.
LIMIT_S = 300
BOOKKEEPING = ".tunepod-manifest"


def data_tree(root: Path) -> dict[str, bytes]:
    """Every data file under ``root`` (tunepod's bookkeeping left out) and its bytes."""
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.name.startswith(BOOKKEEPING)
    }


@pytest.mark.skipif(not AWS.exists(), reason="the AWS CLI comes with the bench extra")
def test_tunepod_stages_the_same_tree_as_the_aws_cli(tmp_path: Path) -> None:
    figures_file = tmp_path / "figures.json"
    argv = [sys.executable, "-m", "benchmarks.staging", "--dir", str(tmp_path / "bench"), "--keep"]
    argv += ["--small-files", "12", "--small-kb", "3", "--large-files", "1", "--large-mb", "1.5"]
    argv += [
        "--repeats",
        "1",
        "--tables",
        "s3",
        "--sides",
        "aws",
        "--no-restage",
        "--json",
        str(figures_file),
    ]
    done = subprocess.run(
        argv, cwd=REPO, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True,
        timeout=LIMIT_S, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for line in ("1. S3 stage", "goal (the issue's goals): tunepod throughput >= 0.9x"):
        assert line in done.stdout, output

    figures = json.loads(figures_file.read_text())
    assert figures["failures"] == []
    work = Path(figures["dir"])
    source = data_tree(work / "source")
    assert len(source) == 13
    assert data_tree(work / "s3" / "tunepod-0") == data_tree(work / "s3" / "aws-0") == source

    rows = figures["s3"]["rows"]
    assert set(rows) == {"aws", "tunepod"} and figures["s3"]["best_baseline"] == "aws"
    assert all(row["identical"] for row in rows.values()), rows
    assert all(math.isfinite(row["ratio"]) and row["ratio"] > 0 for row in rows.values()), rows
    assert figures["s3"]["listing_floor_s"] > 0
