"""The local stack's runner (tunepod/stack/runner.py): a real fork server on a real Unix socket, its
callers real processes, the faults real signals. The runner here forks a small command
(tests/fixtures/runner_service.py) instead of `tunepod run`, so that each test takes a second; the
stack tests (test_stack.py) run `tunepod run` through the stack's own runner."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tunepod.launch.local import read_process_stat
from tunepod.stack.runner import RUNNER_ENV, ping
from tunepod.stack.watch import run_environment_defaults

SERVICE = Path(__file__).resolve().parents[1] / "fixtures" / "runner_service.py"
NOT_TAKEN = 99  # runner_service.py's exit when the runner did not take the command
LIMIT_S = 30.0


STACK_API = "http://127.0.0.1:9/api"  # the runner's "stack" Prefect server: never called by the commands


def caller_env(**changes: str) -> dict[str, str]:
    """This environment as a shell's with no Prefect server chosen, plus ``changes``."""
    return {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}, **changes}


@dataclass(frozen=True)
class RunningRunner:
    home: Path
    source: Path
    """A file the runner counts as its own code."""
    process: subprocess.Popen[bytes]

    def call(
        self, *args: str, env: dict[str, str] | None = None, stdin: str = ""
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args), env=env or caller_env(), input=stdin, capture_output=True, text=True,
            timeout=LIMIT_S, check=False,
        )  # fmt: skip

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, str(SERVICE), "call", str(self.home), *args]


@contextlib.contextmanager
def started_runner(folder: Path, stack_api: str | None) -> Iterator[RunningRunner]:
    """A runner whose stack's Prefect server is ``stack_api`` (None: it does not answer)."""
    home, source = folder / "home", folder / "code.py"
    source.write_text("# the runner's code\n")
    # As the stack starts it (tunepod.stack.services.tunepod_runner): with the run defaults in place.
    env = {**run_environment_defaults(), **caller_env()}
    if stack_api is not None:
        env["PREFECT_API_URL"] = stack_api
    argv = [sys.executable, str(SERVICE), "serve", str(home), str(source)]
    process = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        wait_for(lambda: ping(home) is not None, "the runner to answer")
        yield RunningRunner(home, source, process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[RunningRunner]:
    with started_runner(tmp_path, STACK_API) as running:
        yield running


def test_a_command_runs_in_a_forked_child_with_the_callers_streams_folder_and_environment(
    runner: RunningRunner, tmp_path: Path
) -> None:
    echo = runner.call("echo", "hello", "there")
    assert (echo.returncode, echo.stdout) == (0, "hello there\n"), echo.stderr
    child = int(echo.stderr.split("runner (process ")[1].split(")")[0])
    assert child != runner.process.pid

    # The command's notes go to the same stderr once the runner answers, before or after the child's line.
    assert "to stderr" in runner.call("warn", "to stderr").stderr.splitlines()
    assert runner.call("read", stdin="from stdin\n").stdout == "read: from stdin\n"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = subprocess.run(
        runner.argv("cwd"), cwd=elsewhere, env=caller_env(), capture_output=True, text=True, check=False
    )
    assert moved.stdout == f"{elsewhere}\n", moved.stderr
    # Variables that no preloaded module reads at import may differ: the child takes the caller's.
    assert runner.call("env", "TUNEPOD_EXAMPLE", env=caller_env(TUNEPOD_EXAMPLE="42")).stdout == "42\n"
    assert runner.call("env", RUNNER_ENV).stdout == "off\n"  # a child never forwards again


def test_a_caller_that_chose_no_prefect_server_gets_the_stacks_and_the_run_defaults(
    runner: RunningRunner,
) -> None:
    api = runner.call("env", "PREFECT_API_URL")
    assert api.stdout == f"{STACK_API}\n"
    assert f"using the Prefect server of the local stack: {STACK_API}" in api.stderr
    assert runner.call("env", "PREFECT_CLIENT_MAX_RETRIES").stdout == "7\n"
    # One who chose the same server is served too, without the note.
    same = runner.call("env", "PREFECT_API_URL", env=caller_env(PREFECT_API_URL=STACK_API))
    assert same.stdout == f"{STACK_API}\n" and "using the Prefect server" not in same.stderr


def test_with_the_stacks_prefect_server_down_the_caller_runs_in_its_own_process(tmp_path: Path) -> None:
    with started_runner(tmp_path, stack_api=None) as runner:
        refused = runner.call("echo", "x")
    assert (refused.returncode, refused.stdout) == (NOT_TAKEN, "")
    assert "did not take the run: the local stack's Prefect server does not answer" in refused.stderr


def test_the_childs_exit_status_is_the_callers_and_a_crash_stays_in_the_child(runner: RunningRunner) -> None:
    assert runner.call("exit", "3").returncode == 3
    crashed = runner.call("raise")
    assert crashed.returncode == 1
    assert "RuntimeError: boom in the child" in crashed.stderr, crashed.stderr
    # The crashed child did not fall back into the runner's loop: the runner is the one that answers,
    # and it still serves.
    assert ping(runner.home) == runner.process.pid
    assert runner.call("echo", "still here").stdout == "still here\n"


@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)],
    ids=["sigterm-handled-by-the-child", "sigint-kills-like-ctrl-c"],
)
def test_a_signal_to_the_caller_reaches_the_child(
    runner: RunningRunner, tmp_path: Path, signum: signal.Signals, status: int
) -> None:
    pid_file = tmp_path / "child.pid"
    caller = subprocess.Popen(
        runner.argv("sleep", str(pid_file)), stderr=subprocess.PIPE, text=True, env=caller_env()
    )
    wait_for(pid_file.exists, "the child to start")
    caller.send_signal(signum)
    assert caller.wait(timeout=LIMIT_S) == status, caller.stderr.read() if caller.stderr else ""
    wait_for(lambda: gone(int(pid_file.read_text())), "the child to end")


def test_a_killed_caller_takes_its_child_with_it(runner: RunningRunner, tmp_path: Path) -> None:
    """Fault: SIGKILL of the caller's process group (as of a `tunepod run` killed mid-run). Without
    the runner its run would die with it; with it, the runner kills the child when the socket closes."""
    pid_file = tmp_path / "child.pid"
    caller = subprocess.Popen(runner.argv("sleep", str(pid_file)), start_new_session=True, env=caller_env())
    wait_for(pid_file.exists, "the child to start")
    child = int(pid_file.read_text())
    os.killpg(caller.pid, signal.SIGKILL)
    caller.wait()
    wait_for(lambda: gone(child), "the runner to kill the orphaned child")
    assert runner.call("echo", "next").stdout == "next\n"


def test_a_stopped_runner_leaves_its_run_going_and_the_caller_says_so(
    runner: RunningRunner, tmp_path: Path
) -> None:
    """Fault: SIGTERM of the runner's process group (what `tunepod down` sends) while a run is on. Its
    child is a session of its own, as a flow run in flight is not the stack's to kill."""
    pid_file, log = tmp_path / "child.pid", tmp_path / "caller.log"
    with log.open("w") as stderr:  # a file: the child, still running, holds the caller's stderr open
        caller = subprocess.Popen(runner.argv("sleep", str(pid_file)), env=caller_env(), stderr=stderr)
    wait_for(pid_file.exists, "the child to start")
    child = int(pid_file.read_text())
    try:
        os.killpg(runner.process.pid, signal.SIGTERM)
        assert caller.wait(timeout=LIMIT_S) == 1
        assert f"lost the stack's runner while the run (process {child}) was going on" in log.read_text()
        assert not gone(child)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("name", ["PREFECT_LOGGING_LEVEL", "MLFLOW_TRACKING_URI"])
def test_a_caller_with_other_prefect_or_mlflow_settings_runs_in_its_own_process(
    runner: RunningRunner, name: str
) -> None:
    refused = runner.call("echo", "x", env=caller_env(**{name: "something else"}))
    assert refused.returncode == NOT_TAKEN
    assert refused.stdout == ""
    assert f"did not take the run: {name} differ from the runner's environment" in refused.stderr
    assert refused.stderr.count("did not take the run") == 1  # a refused caller does not ask again


def test_changed_code_is_refused_until_the_runner_restarts(runner: RunningRunner) -> None:
    later = time.time_ns() + 10**9
    os.utime(runner.source, ns=(later, later))
    refused = runner.call("echo", "x")
    assert refused.returncode == NOT_TAKEN
    assert f"{runner.source} changed since the runner started; restart it: tunepod down && tunepod up" in (
        refused.stderr
    )


def test_no_runner_or_runner_off_means_the_callers_own_process(runner: RunningRunner, tmp_path: Path) -> None:
    off = runner.call("echo", "x", env=caller_env(**{RUNNER_ENV: "off"}))
    assert (off.returncode, off.stdout, off.stderr) == (NOT_TAKEN, "", "")
    nobody = subprocess.run(
        [sys.executable, str(SERVICE), "call", str(tmp_path / "no-stack-here"), "echo", "x"],
        env=caller_env(), capture_output=True, text=True, timeout=LIMIT_S, check=False,
    )  # fmt: skip
    assert (nobody.returncode, nobody.stdout, nobody.stderr) == (NOT_TAKEN, "", "")


def gone(pid: int) -> bool:
    stat = read_process_stat(pid)
    return stat is None or stat.is_dead


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# The caller installs its forwarding handlers just after the runner's answer; the runner may start the
# child before that answer arrives, so a signal can come first. Too narrow to hit from outside on
# purpose (the test above met it once, under load): here the signal comes, in a process of its own,
# while the caller holds signals, which it now does from its request on.
HELD_SIGNAL = """
import os, signal, socket
from tunepod.stack import runner
mine, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
with runner._signals_held():
    os.kill(os.getpid(), signal.SIGHUP)  # would end this process here, were it not held
    with runner._forwarding_signals(mine):
        pass
print(runner._receive(peer))
"""


def test_a_signal_that_comes_before_forwarding_starts_is_forwarded_not_fatal() -> None:
    done = subprocess.run([sys.executable, "-c", HELD_SIGNAL], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.strip() == str({"signal": int(signal.SIGHUP)})
