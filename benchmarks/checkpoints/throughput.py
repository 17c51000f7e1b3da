"""Checkpoint write throughput against ``dd`` and ``cp`` of the same bytes into the same folder.

The bytes are those of the state's ``torch.save`` file: ``dd`` and ``cp`` copy that file (read from
the page cache, where it was just written), each writer to a new file that it fsyncs; the Python
writers write the state from memory. MB/s = bytes / wall seconds of the write (for the commands:
of the process, start to exit).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The writer every other one is divided by.
DD = "dd conv=fsync"
CHUNK_ELEMENTS = 4 << 20  # 16 MB float32 tensors


@dataclass(frozen=True)
class Throughput:
    writer: str
    seconds: list[float]
    bytes: int
    error: str | None = None

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / statistics.median(self.seconds) if self.seconds else float("nan")


def make_state(megabytes: float) -> dict[str, Any]:
    """A model-like state of ``megabytes``: float32 tensors of random values (nothing compressible)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    elements = int(megabytes * 1e6 / 4)
    tensors = {}
    for index, start in enumerate(range(0, elements, CHUNK_ELEMENTS)):
        count = min(CHUNK_ELEMENTS, elements - start)
        tensors[f"layer{index}.weight"] = torch.randn(count, generator=generator)
    return {"model": tensors, "step": 1}


def measure(folder: Path, megabytes: float, repeats: int) -> list[Throughput]:
    """Each writer ``repeats`` times, alternating, into ``folder``; the medians' inputs."""
    import torch

    from tunepod.runtime import checkpoints
    from tunepod.runtime.sharded import ShardedCheckpointer

    folder.mkdir(parents=True, exist_ok=True)
    state = make_state(megabytes)
    source = folder / "source.pt"
    torch.save(state, source)
    size = source.stat().st_size
    step = iter(range(1, 1 << 30))

    def torch_save_fsync(target: Path) -> None:
        with open(target, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())

    def tunepod_save(target: Path) -> None:
        checkpoints.save_checkpoint(target, state, next(step), keep=1)

    def tunepod_sharded(target: Path) -> None:
        with warnings.catch_warnings():  # one process, no process group: DCP says so each time
            warnings.simplefilter("ignore")
            ShardedCheckpointer(target, keep=1, world_size=1).save(state, next(step), None)

    writers: dict[str, Callable[[Path], None]] = {
        DD: lambda target: command(
            ["dd", f"if={source}", f"of={target}", "bs=4M", "conv=fsync", "status=none"]
        ),
        "dd oflag=direct": lambda target: command(
            ["dd", f"if={source}", f"of={target}", "bs=4M", "oflag=direct", "conv=fsync", "status=none"]
        ),
        "cp + sync FILE": lambda target: command(
            ["sh", "-c", 'cp "$0" "$1" && sync "$1"', str(source), str(target)]
        ),
        "torch.save + fsync": torch_save_fsync,
        "tunepod save": tunepod_save,
        "tunepod sharded save (1 process)": tunepod_sharded,
    }
    seconds: dict[str, list[float]] = {name: [] for name in writers}
    errors: dict[str, str] = {}
    for _ in range(repeats):
        for name, write in writers.items():
            if name in errors:
                continue
            target = folder / name.replace(" ", "_").replace("/", "_")
            remove(target)
            started = time.perf_counter()
            try:
                write(target)
            except (OSError, subprocess.CalledProcessError) as exc:
                errors[name] = str(getattr(exc, "stderr", None) or exc).strip()
                continue
            seconds[name].append(time.perf_counter() - started)
            remove(target)
    remove(source)
    return [Throughput(name, seconds[name], size, errors.get(name)) for name in writers]


def command(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
