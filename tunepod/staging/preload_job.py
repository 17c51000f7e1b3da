"""Preload a dataset on FSx for Lustre: ``lfs hsm_restore`` over every file of the data folder.

Runs as a job on the cluster (a stage step with ``fsx.preload: true`` submits it through the
pipeline's launcher), because only the nodes mount the file system with a Lustre client. After a
metadata import the files are listed but their contents still live in S3; ``hsm_restore`` asks FSx
to load them now, so the first training epoch does not wait on S3. The request returns once FSx
has queued the restores; they complete in the background.

Contract: ``TUNEPOD_DATA_DIR`` is the folder; ``TUNEPOD_PARAMS`` may set ``num_files_per_batch``.
Rank 0 does the work and reports after each batch (``num_restored``); the result holds
``num_files``, ``num_bytes``, ``num_batches``. Without ``lfs`` on PATH it exits 2 with a message
saying preload needs a Lustre client. Standard library plus ``tunepod.runtime`` only: it runs on
any training image.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tunepod import runtime

DEFAULTS = {"num_files_per_batch": 256}
NO_LUSTRE_EXIT = 2


def data_files(folder: Path) -> list[Path]:
    """Every regular file under ``folder``, in a stable order."""
    found: list[Path] = []
    for parent, _, names in os.walk(folder):
        found.extend(Path(parent, name) for name in sorted(names))
    return sorted(path for path in found if path.is_file() and not path.is_symlink())


def restore(lfs: str, batch: list[Path]) -> None:
    """One ``lfs hsm_restore`` call; raises ``SystemExit`` with lfs's own words when it fails."""
    done = subprocess.run([lfs, "hsm_restore", *map(str, batch)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"`lfs hsm_restore` failed (exit {done.returncode}) on a batch starting at {batch[0]}: "
            f"{done.stderr.strip() or done.stdout.strip()}"
        )


def main() -> None:
    ctx = runtime.init(DEFAULTS)
    if not ctx.is_main:
        return  # one process restores; FSx loads the files in parallel on its side
    lfs = shutil.which("lfs")
    if lfs is None:
        print(
            "preload needs a Lustre client: `lfs` is not on PATH on this node, so the files of "
            f"{ctx.data_dir} cannot be restored; fix: run the pipeline's jobs on nodes that mount FSx "
            "for Lustre (the lustre-client package provides lfs), or set fsx.preload: false",
            file=sys.stderr,
        )
        raise SystemExit(NO_LUSTRE_EXIT)
    files = data_files(ctx.data_dir)
    size = int(ctx.params["num_files_per_batch"])
    batches = [files[start : start + size] for start in range(0, len(files), size)]
    for number, batch in enumerate(batches):
        restore(lfs, batch)
        ctx.report(number, num_restored=float(min((number + 1) * size, len(files))))
    ctx.finish(
        num_files=float(len(files)),
        num_bytes=float(sum(path.stat().st_size for path in files)),
        num_batches=float(len(batches)),
    )


if __name__ == "__main__":
    main()
