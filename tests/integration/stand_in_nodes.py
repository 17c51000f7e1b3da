"""Two torchrun agents on this host standing in for the two nodes of a job, each with its own memory
folder through its own ``TUNEPOD_CHECKPOINT_TIERS`` (memory every 2 steps, shared every 6, one
replica), so each agent stands in for a node with its own RAM: the harness of ``test_memory_tier.py``
and ``test_elastic.py``. Killing a node is SIGKILL to its agent's process group and to its worker's
(torchrun starts each worker in a session of its own); its memory folder going stands in for its RAM.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

from tunepod import runtime

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
NODES = ("a", "b")


class StandInNodes:
    """One job's folders, and its two stand-in nodes started as torchrun agents running ``job``.

    ``agent_args(node, port)`` are torchrun's arguments before the script (the rendezvous on this
    host's ``port``); each worker writes ``<out>/<seen_file(node)>`` with its pid, so that a kill
    reaches it."""

    def __init__(
        self,
        tmp: Path,
        job: Path,
        agent_args: Callable[[str, int], list[str]],
        seen_file: Callable[[str], str],
        timeout_s: float,
    ) -> None:
        self.tmp = tmp
        self.out = tmp / "out"
        self.out.mkdir()
        self.checkpoints = tmp / "checkpoints"
        self.metrics = tmp / "metrics.jsonl"
        self.job = job
        self.agent_args = agent_args
        self.seen_file = seen_file
        self.timeout_s = timeout_s
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def memory_dir(self, node: str) -> Path:
        return self.tmp / f"shm-{node}"

    def job_folder(self, node: str) -> Path:
        (found,) = (self.memory_dir(node) / "tunepod").iterdir()
        return found

    def start(self, *args: str) -> None:
        """Both agents, the job's script given ``args``; what an earlier start saw is cleared."""
        for path in self.out.iterdir():
            path.unlink()
        port = free_port()
        for node in NODES:
            log = open(self.tmp / f"agent-{node}.log", "ab")  # noqa: SIM115 - the agent keeps it
            self.agents[node] = subprocess.Popen(
                [str(TORCHRUN), *self.agent_args(node, port), str(self.job), *args],
                env=self._env(node),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _env(self, node: str) -> dict[str, str]:
        tiers = runtime.CheckpointTiers(2, 6, memory_replicas=1, memory_dir=str(self.memory_dir(node)))
        return {
            **os.environ,
            "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
            runtime.CHECKPOINT_DIR_ENV: str(self.checkpoints),
            runtime.METRICS_FILE_ENV: str(self.metrics),
            runtime.RESULT_FILE_ENV: str(self.tmp / "result.json"),
            runtime.CHECKPOINT_TIERS_ENV: tiers.to_json(),
            "TEST_OUT": str(self.out),
            "TEST_NODE": node,
            "OMP_NUM_THREADS": "1",
        }

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; logs:\n{self.logs()}")
            time.sleep(0.2)

    def kill(self, node: str) -> None:
        """The node is gone: its agent's process group and its worker's session, SIGKILLed."""
        seen = self.out / self.seen_file(node)
        groups = [self.agents[node].pid] + ([json.loads(seen.read_text())["pid"]] if seen.exists() else [])
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.agents[node].wait(timeout=30)

    def lose_memory(self, node: str) -> None:
        """The node's RAM went with it."""
        shutil.rmtree(self.memory_dir(node), ignore_errors=True)

    def finished(self, node: str | None = None) -> None:
        """Every agent (or ``node``'s) exits 0 within the time limit."""
        for name, agent in self.agents.items():
            if node is not None and name != node:
                continue
            try:
                assert agent.wait(timeout=self.timeout_s) == 0, f"agent {name} failed; logs:\n{self.logs()}"
            except subprocess.TimeoutExpired:
                pytest.fail(f"agent {name} did not finish; logs:\n{self.logs()}")

    def seen(self, name: str) -> dict[str, Any]:
        """What a worker wrote to ``<out>/<name>``."""
        return dict(json.loads((self.out / name).read_text()))

    def logs(self, tail: int = 4000) -> str:
        return "\n".join(p.read_text(errors="replace")[-tail:] for p in sorted(self.tmp.glob("agent-*.log")))

    def stop_all(self) -> None:
        for node, agent in self.agents.items():
            if agent.poll() is None:
                self.kill(node)
