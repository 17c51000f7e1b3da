"""Heartbeats (``tunepod.runtime.progress``) and what the driver reads from them (``launch.watchdog``).

The heartbeat tests run the real thread; the watchdog tests write heartbeat files as a job's ranks
would and ask at a chosen ``now``, so no test sleeps for a timeout. The hang itself, for real, is in
``tests/e2e/test_faults.py``. The telemetry tests (``step_done``) time real loops and a real
process's peak memory, asserting only lower bounds that a sleep guarantees.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tunepod import runtime, world
from tunepod.launch.paths import JobPaths
from tunepod.launch.watchdog import Limits, RunningSince, Watchdog
from tunepod.runtime.contract import CHECKPOINT_DIR_ENV, METRICS_FILE_ENV, RANK_ENV
from tunepod.runtime.progress import (
    HEARTBEAT_S_ENV,
    Heartbeat,
    RankProgress,
    StepMeter,
    StepTelemetry,
    peak_memory,
    read_progress,
)
from tunepod.world import RealWorld


def torch_cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def wait_until(condition: Callable[[], object], what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_loop_that_stops_advancing_keeps_beating_with_its_last_advance(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path, rank=3, interval_s=0.05).start()
    beat.advance(7)
    wait_until(lambda: read_progress(tmp_path) and read_progress(tmp_path)[0].step == 7, "step 7")
    first = read_progress(tmp_path)[0]
    wait_until(lambda: read_progress(tmp_path)[0].beat_at > first.beat_at + 0.1, "later beats")
    later = read_progress(tmp_path)[0]
    beat.finish()
    assert (later.rank, later.step, later.finished) == (3, 7, False)
    assert later.advanced_at == first.advanced_at, "no advance happened: the advance time must not move"
    assert read_progress(tmp_path)[0].finished


def test_runtime_init_in_a_job_starts_every_ranks_heartbeat(tmp_path: Path) -> None:
    env = {METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"), RANK_ENV: "1", HEARTBEAT_S_ENV: "0.05"}
    ctx = runtime.init({}, environ=env)
    ctx.heartbeat(4)
    wait_until(lambda: [b.step for b in read_progress(tmp_path / "progress")] == [4], "rank 1's beat")
    ctx.finish(score=1.0)  # rank 1: writes no result, but says its loop is over
    [beat] = read_progress(tmp_path / "progress")
    assert (beat.rank, beat.finished) == (1, True)
    assert not (tmp_path / "result.json").exists()


def test_runtime_init_outside_a_job_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runtime.init({}, environ={})
    assert list(tmp_path.iterdir()) == []


def test_a_bad_heartbeat_interval_names_the_variable(tmp_path: Path) -> None:
    env = {METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"), HEARTBEAT_S_ENV: "soon"}
    with pytest.raises(ValueError, match=f"{HEARTBEAT_S_ENV}='soon' is not a number of seconds"):
        runtime.init({}, environ=env)


def write_beat(paths: JobPaths, rank: int, *, advanced_at: float, beat_at: float, **more: object) -> None:
    beat = RankProgress(
        rank=rank, host="node-1", pid=100 + rank, started_at=advanced_at - 10, beat_at=beat_at,
        advanced_at=advanced_at, step=5, interval_s=10.0, **more,  # type: ignore[arg-type]
    )  # fmt: skip
    paths.progress.mkdir(parents=True, exist_ok=True)
    (paths.progress / f"rank-{rank}.json").write_text(json.dumps(asdict(beat)))


def test_the_run_time_clock_survives_a_new_driver_and_restarts_with_a_new_job(
    tmp_path: Path, clocks: ManualClocks
) -> None:
    paths = JobPaths(tmp_path)
    first = Watchdog(paths, Limits(timeout_s=60))
    since = first.running_since("job-1")
    assert not first.timed_out("job-1", clocks.wall)
    clocks.advance(40)
    assert not first.timed_out("job-1", clocks.wall)  # no heartbeat: the 40 s it watched are recorded
    restarted_orchestrator = Watchdog(paths, Limits(timeout_s=60))
    assert restarted_orchestrator.running_since("job-1") == since
    assert not restarted_orchestrator.timed_out("job-1", clocks.wall)
    clocks.advance(21)
    assert restarted_orchestrator.timed_out("job-1", clocks.wall), "a re-attach must not get a fresh budget"
    assert restarted_orchestrator.running_since("job-2") >= since  # a new attempt: a new clock
    assert RunningSince.model_validate_json(paths.running.read_bytes()).job_id == "job-2"


def test_the_first_heartbeat_starts_the_clock_when_no_driver_saw_the_job_start(tmp_path: Path) -> None:
    paths = JobPaths(tmp_path)
    now = time.time()
    write_beat(paths, 0, advanced_at=now - 500, beat_at=now)
    assert Watchdog(paths, Limits()).running_since("job-1") == pytest.approx(now - 510)


class ManualClocks(RealWorld):
    """The real world with clocks the test sets: the driver's wall clock and its monotonic clock."""

    def __init__(self, wall: float) -> None:
        self.wall = wall
        self.mono = 1000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@pytest.fixture
def clocks() -> Iterator[ManualClocks]:
    with world.installed(ManualClocks(time.time())) as installed:
        assert isinstance(installed, ManualClocks)
        yield installed


def test_a_stall_names_the_stuck_ranks_and_tells_alive_from_gone(
    tmp_path: Path, clocks: ManualClocks
) -> None:
    paths = JobPaths(tmp_path)
    now = clocks.wall
    write_beat(paths, 0, advanced_at=now - 100, beat_at=now - 1)  # alive, stuck for 99 s by its own clock
    write_beat(paths, 1, advanced_at=now - 120, beat_at=now - 90)  # stopped beating 30 s after advancing
    write_beat(paths, 2, advanced_at=now - 1, beat_at=now - 1)  # fine
    watchdog = Watchdog(paths, Limits(hang_timeout_s=60))
    first = watchdog.stall("job-1", now)
    # Rank 1's silence is not measured on another host's clock: this driver must hear it last.
    assert first is not None and first.stalled_ranks == [0]
    clocks.advance(40)  # rank 0 beats on without advancing; ranks 1 and 2 say nothing new
    write_beat(paths, 0, advanced_at=now - 100, beat_at=now + 39)
    stall = watchdog.stall("job-1", clocks.wall)
    assert stall is not None and stall.stalled_ranks == [0, 1]
    described = stall.describe()
    assert described.startswith("no progress for 70 s (last step 5); stopped: rank 0 on node-1 pid 100")
    assert "rank 0 on node-1 pid 100 advanced 139 s ago, alive" in described
    assert "rank 1 on node-1 pid 101 advanced 70 s ago, its heartbeat stopped 40 s ago" in described
    assert Watchdog(paths, Limits(hang_timeout_s=150)).stall("job-1", clocks.wall) is None


def test_a_finished_rank_waiting_for_the_others_is_not_a_hang(tmp_path: Path, clocks: ManualClocks) -> None:
    paths = JobPaths(tmp_path)
    now = clocks.wall
    write_beat(paths, 0, advanced_at=now - 1, beat_at=now - 1)
    write_beat(paths, 1, advanced_at=now - 500, beat_at=now - 500, finished=True)
    assert Watchdog(paths, Limits(hang_timeout_s=60)).stall("job-1", now) is None


def test_no_heartbeat_past_the_startup_allowance_is_a_hang(tmp_path: Path, clocks: ManualClocks) -> None:
    paths = JobPaths(tmp_path)
    watchdog = Watchdog(paths, Limits(hang_timeout_s=60, startup_timeout_s=300))
    assert watchdog.stall("job-1", clocks.wall) is None  # the first look at it running
    clocks.advance(299)
    assert watchdog.stall("job-1", clocks.wall) is None
    clocks.advance(2)
    stall = watchdog.stall("job-1", clocks.wall)
    assert stall is not None
    assert stall.describe() == "no rank sent a heartbeat in 301 s of running (stuck starting up?)"


def test_a_jump_of_the_orchestrators_clock_neither_hangs_nor_times_out_a_job(
    tmp_path: Path, clocks: ManualClocks
) -> None:
    """An NTP step or a resumed VM moves the driver's wall clock by an hour: the job's ranks, which
    beat and advance on their own clocks, are neither hung nor over their time."""
    paths = JobPaths(tmp_path)
    now = clocks.wall
    write_beat(paths, 0, advanced_at=now - 5, beat_at=now - 1)
    watchdog = Watchdog(paths, Limits(timeout_s=600, hang_timeout_s=60))
    assert watchdog.running_since("job-1") <= now
    clocks.wall += 3600  # the jump; the monotonic clock does not move
    assert watchdog.stall("job-1", clocks.wall) is None
    assert not watchdog.timed_out("job-1", clocks.wall)


def test_a_step_of_a_ranks_own_clock_after_its_advance_is_not_idleness(
    tmp_path: Path, clocks: ManualClocks
) -> None:
    """Found by the simulation: the clock of the host a local job runs on stepped between an advance
    and the next beat, and ``beat_at - advanced_at`` measured the step as idleness. A beat carries
    its idleness and run time on the rank's monotonic clock; a beat without them (an older runtime)
    is still read on its wall clock."""
    paths = JobPaths(tmp_path)
    now = clocks.wall
    write_beat(paths, 0, advanced_at=now - 3605, beat_at=now, idle_s=5.0, ran_s=100.0)  # an hour's step
    watchdog = Watchdog(paths, Limits(hang_timeout_s=60))
    assert watchdog.stall("job-1", now) is None
    write_beat(paths, 0, advanced_at=now - 3605, beat_at=now)
    assert Watchdog(paths, Limits(hang_timeout_s=60)).stall("job-1", now) is not None


def test_a_heartbeat_measures_idleness_and_run_time_on_the_monotonic_clock(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path, rank=0, interval_s=0.05).start()
    time.sleep(0.2)
    beat.advance(1)
    wait_until(lambda: read_progress(tmp_path)[0].step == 1, "the advance to be beaten")
    wait_until(lambda: (read_progress(tmp_path)[0].idle_s or 0) >= 0.1, "idleness to grow")
    last = read_progress(tmp_path)[0]
    beat.finish()
    assert last.idle_s is not None and last.ran_s is not None
    assert last.ran_s >= last.idle_s + 0.2, "the run began 0.2 s before the advance"


def test_without_heartbeats_a_jump_of_the_orchestrators_clock_does_not_time_out_a_job(
    tmp_path: Path, clocks: ManualClocks
) -> None:
    """A job that writes no heartbeats (an evaluation; SageMaker without a writable FSx): its driver's
    wall clock jumps, and a driver on a host whose clock runs ahead takes it over. Only the time
    drivers watched it running counts, so neither stops it before it has run its limit."""
    paths = JobPaths(tmp_path)
    watchdog = Watchdog(paths, Limits(timeout_s=600))
    assert not watchdog.timed_out("job-1", clocks.wall)
    clocks.advance(100)
    clocks.wall += 3600  # the jump; the monotonic clock does not move
    assert not watchdog.timed_out("job-1", clocks.wall)
    ahead = Watchdog(paths, Limits(timeout_s=600))  # the next driver, its host's clock an hour ahead
    assert not ahead.timed_out("job-1", clocks.wall)
    clocks.advance(499)
    assert not ahead.timed_out("job-1", clocks.wall)
    clocks.advance(2)
    assert ahead.timed_out("job-1", clocks.wall)  # 601 s watched, the 100 s of the first driver included


def test_a_requeue_nobody_saw_does_not_time_out_the_new_run(tmp_path: Path, clocks: ManualClocks) -> None:
    """Slurm requeued the job while the orchestrator was down: running.json keeps the first run's
    start, but the new run's ranks started 60 s ago by their own clocks."""
    paths = JobPaths(tmp_path)
    now = clocks.wall
    first_run = RunningSince(job_id="1234", since=now - 4000)
    paths.running.write_text(first_run.model_dump_json())
    beat = RankProgress(
        rank=0, host="node-2", pid=7, started_at=now - 60, beat_at=now - 2, advanced_at=now - 3, step=1,
        interval_s=10.0,
    )  # fmt: skip
    paths.progress.mkdir(parents=True)
    (paths.progress / "rank-0.json").write_text(json.dumps(asdict(beat)))
    watchdog = Watchdog(paths, Limits(timeout_s=3600, hang_timeout_s=600))
    assert not watchdog.timed_out("1234", now)
    clocks.advance(3600)  # the new run's ranks then beat on past its limit: now it is over
    (paths.progress / "rank-0.json").write_text(json.dumps(asdict(replace(beat, beat_at=now + 3598))))
    assert watchdog.timed_out("1234", clocks.wall)


def test_a_requeue_starts_both_clocks_afresh(tmp_path: Path) -> None:
    paths = JobPaths(tmp_path)
    now = time.time()
    write_beat(paths, 0, advanced_at=now - 500, beat_at=now - 400)
    watchdog = Watchdog(paths, Limits(timeout_s=600, hang_timeout_s=60))
    assert watchdog.stall("job-1", now) is not None and watchdog.running_since("job-1") < now - 500
    watchdog.new_run("job-1")  # Slurm put the job back in its queue
    assert watchdog.stall("job-1", now) is None
    assert watchdog.running_since("job-1") >= now


def beat_of(started_at: float, advanced_at: float, beat_at: float, *, host: str, pid: int) -> str:
    beat = RankProgress(
        rank=0, host=host, pid=pid, started_at=started_at, beat_at=beat_at, advanced_at=advanced_at,
        step=3, interval_s=10.0,
    )  # fmt: skip
    return json.dumps(asdict(beat))


def test_a_rank_a_lost_node_left_behind_does_not_stop_the_run_after_it(
    tmp_path: Path, clocks: ManualClocks
) -> None:
    """Found by the simulation (a Slurm node whose slurmd died): the job is requeued, or ends
    NODE_FAIL and is restarted, while its rank on that node lives on, stuck in a collective whose peers
    Slurm killed, and goes on writing rank-0.json beside the next run's rank. Its beat (started 500 s
    ago, advanced 300 s ago) is not the next run's: neither hung nor over its time."""
    paths = JobPaths(tmp_path)
    now = clocks.wall
    left_behind = beat_of(now - 500, now - 300, now - 1, host="node-1", pid=7)
    paths.progress.mkdir(parents=True)
    (paths.progress / "rank-0.json").write_text(left_behind)
    watchdog = Watchdog(paths, Limits(timeout_s=400, hang_timeout_s=60))
    assert watchdog.stall("1234", now) is not None  # while it was the job's run, it was hung
    watchdog.new_run("1234")  # requeued (or restarted after NODE_FAIL)
    clocks.advance(60)
    (paths.progress / "rank-0.json").write_text(beat_of(now + 40, now + 58, now + 59, host="node-2", pid=8))
    assert watchdog.stall("1234", clocks.wall) is None
    (paths.progress / "rank-0.json").write_text(left_behind.replace(str(now - 1), str(now + 60)))
    assert watchdog.stall("1234", clocks.wall) is None
    assert not watchdog.timed_out("1234", clocks.wall)
    # The next driver (the orchestrator restarted) reads only the left-behind beat, and passes it over.
    assert Watchdog(paths, Limits(timeout_s=400, hang_timeout_s=60)).stall("1234", clocks.wall) is None


def test_the_next_run_counts_though_its_nodes_clock_stepped_back_between_the_runs(
    tmp_path: Path, clocks: ManualClocks
) -> None:
    """Found by the simulation: a local job's host clock stepped back 99 s between a restart and the
    new run's first beat, whose start then read as older than the ended run's; taken for a left-behind
    rank, the new run looked silent and was stopped as stuck starting up. Earlier runs' ranks are
    known by identity (host, pid, start), not by a start compared across runs."""
    paths = JobPaths(tmp_path)
    now = clocks.wall
    paths.progress.mkdir(parents=True)
    (paths.progress / "rank-0.json").write_text(beat_of(now - 30, now - 2, now - 1, host="node-1", pid=7))
    watchdog = Watchdog(paths, Limits(hang_timeout_s=60, startup_timeout_s=30))
    assert watchdog.stall("job-1", now) is None
    watchdog.new_run("job-1")  # restarted
    assert watchdog.stall("job-2", now) is None  # the first look at the new job running
    clocks.advance(40)
    (paths.progress / "rank-0.json").write_text(beat_of(now - 90, now - 90, now - 89, host="node-1", pid=9))
    assert watchdog.stall("job-2", clocks.wall) is None, "the new run's beat was taken for the old run's"
    (paths.progress / "rank-0.json").write_text(beat_of(now - 30, now - 2, now + 39, host="node-1", pid=7))
    assert watchdog.stall("job-2", clocks.wall) is None  # the old run's rank, beating on: passed over


def test_a_rank_left_behind_by_a_requeue_nobody_saw_gives_way_to_the_new_run(
    tmp_path: Path, clocks: ManualClocks
) -> None:
    """No driver saw the requeue: once the new run's rank has been heard, the older run's beats in the
    same file are passed over, and the new run's last beat stands for the rank."""
    paths = JobPaths(tmp_path)
    now = clocks.wall
    paths.progress.mkdir(parents=True)
    (paths.progress / "rank-0.json").write_text(beat_of(now - 30, now - 2, now - 1, host="node-2", pid=8))
    watchdog = Watchdog(paths, Limits(timeout_s=400, hang_timeout_s=60))
    assert watchdog.stall("1234", now) is None
    (paths.progress / "rank-0.json").write_text(beat_of(now - 500, now - 300, now, host="node-1", pid=7))
    assert watchdog.stall("1234", now) is None
    assert not watchdog.timed_out("1234", now)


def test_a_stop_signal_near_the_time_limit_is_the_limit_and_earlier_a_preemption(tmp_path: Path) -> None:
    paths = JobPaths(tmp_path)
    watchdog = Watchdog(paths, Limits(timeout_s=3600))
    since = watchdog.running_since("job-1")
    assert watchdog.stop_requested_at() is None
    write_beat(paths, 0, advanced_at=since + 3500, beat_at=since + 3500, stop_requested_at=since + 3500)
    write_beat(paths, 1, advanced_at=since + 3500, beat_at=since + 3500, stop_requested_at=since + 3510)
    asked_at = watchdog.stop_requested_at()
    assert asked_at == since + 3500  # the first rank asked
    assert watchdog.stopped_by_time_limit("job-1", asked_at, grace_s=60)  # --signal=TERM@60, sent early
    assert not watchdog.stopped_by_time_limit("job-1", since + 1000, grace_s=60)


def test_a_preempted_run_is_still_stopped_for_a_driver_that_reattaches_after_its_restart_began(
    tmp_path: Path,
) -> None:
    """Found by the simulation: a driver restarting a preempted job (its script saved and exited 0 on
    the signal) clears the run's heartbeats, then dies before the new attempt is recorded. The next
    driver re-attaches to the old job: its exit 0 is still a stop, not the end of training. A new run
    that beats (a Slurm requeue of the same job id) speaks for itself."""
    paths = JobPaths(tmp_path)
    now = time.time()
    write_beat(paths, 0, advanced_at=now - 5, beat_at=now - 1, stop_requested_at=now - 3)
    Watchdog(paths, Limits(hang_timeout_s=60)).new_run("job-1")
    reattached = Watchdog(paths, Limits(hang_timeout_s=60))
    assert reattached.stop_requested_at("job-1") == now - 3
    assert reattached.stop_requested_at("job-2") is None, "the next attempt's own exit is its own"
    write_beat(paths, 0, advanced_at=now + 20, beat_at=now + 30)
    assert reattached.stop_requested_at("job-1") is None


def run_script(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    """A script in a job (its contract from the environment) that prints "ready" once it loops."""
    script = tmp_path / "script.py"
    script.write_text(f"import sys, time\nfrom tunepod import runtime\nctx = runtime.init({{}})\n{body}")
    env = {**os.environ, METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"), HEARTBEAT_S_ENV: "0.05"}
    env[CHECKPOINT_DIR_ENV] = str(tmp_path / "checkpoints")
    process = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def test_a_script_that_asks_saves_and_exits_on_sigterm_and_its_heartbeat_says_so(tmp_path: Path) -> None:
    process = run_script(
        tmp_path,
        "step = 0\n"
        "while not ctx.should_stop():\n"
        "    step += 1\n"
        "    if step == 1:\n"
        "        print('ready', flush=True)\n"
        "    time.sleep(0.01)\n"
        "ctx.save_checkpoint({'step': step}, step)\n",
    )
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    checkpoint = runtime.latest_checkpoint(tmp_path / "checkpoints")
    assert checkpoint is not None and checkpoint.step >= 1
    [beat] = read_progress(tmp_path / "progress")
    assert beat.stop_signal == "SIGTERM" and beat.stop_requested_at is not None and beat.finished


def test_a_script_that_never_asks_dies_of_sigterm_at_once(tmp_path: Path) -> None:
    process = run_script(tmp_path, "print('ready', flush=True)\ntime.sleep(60)\n")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    [beat] = read_progress(tmp_path / "progress")
    assert beat.stop_signal is None


def test_progress_lines_for_a_log_watching_backend_stop_when_the_loop_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    beat = Heartbeat(tmp_path, rank=2, interval_s=0.02, log_every_s=0.05).start()
    assert capsys.readouterr().out == "tunepod progress: rank 2 step -\n"  # at start: the start cut-off
    beat.advance(3)
    wait_until(lambda: "step 3" in capsys.readouterr().out, "a line for the advance")
    time.sleep(0.3)  # no advance: nothing more to say, and the operator's recurring rule sees silence
    beat.finish()
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------- telemetry


def test_step_done_times_the_steps_of_a_window_and_counts_their_samples_and_tokens() -> None:
    """A real loop: each step sleeps 10 ms, so each measured step lasts at least that (the only
    bound on time asserted); the rates are the window's counts over the window's seconds."""
    meter = StepMeter()
    assert meter.window() is None
    for step in range(5):
        time.sleep(0.01)
        meter.step_done(step, samples=4, tokens=32)  # the first call starts the clock
    first = meter.window()
    assert first is not None
    assert (first.step, first.steps) == (4, 4)
    assert first.step_time_s >= 0.01
    assert first.samples_per_s is not None and first.samples_per_s == pytest.approx(4 / first.step_time_s)
    assert first.tokens_per_s == pytest.approx(8 * first.samples_per_s)
    assert first.memory == "rss" and first.peak_memory_bytes is not None and first.peak_memory_bytes > 0
    assert first.measured_at <= time.time()

    again = meter.window()  # no step ended since: the last window's figures
    assert again is not None and (again.step, again.steps, again.step_time_s) == (4, 4, first.step_time_s)

    for step in range(5, 7):
        time.sleep(0.02)
        meter.step_done(step)  # no counts: only the step time
    second = meter.window()
    assert second is not None and (second.step, second.steps) == (6, 2)
    assert second.step_time_s >= 0.02
    # Counted before, none passed since: 0 per second over this window, not the last window's rate.
    assert second.samples_per_s == 0.0 and second.tokens_per_s == 0.0
    assert second.measured_at > first.measured_at


def test_a_loop_that_never_counts_has_no_rates_and_a_bad_count_names_itself() -> None:
    meter = StepMeter()
    meter.step_done(0)
    meter.step_done(1)
    measured = meter.window()
    assert measured is not None and measured.samples_per_s is None and measured.tokens_per_s is None
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tokens="):
            meter.step_done(2, tokens=bad)


PEAK_SCRIPT = """
import json, sys, time
from tunepod import runtime, world

ctx = runtime.init({})
progress = ctx.metrics_file.parent / "progress"

def peak_after(step):
    ctx.step_done(step, samples=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        beats = runtime.read_progress(progress)
        if beats and beats[0].telemetry is not None and beats[0].telemetry.step == step:
            return beats[0].telemetry.peak_memory_bytes, beats[0].telemetry.memory
        time.sleep(0.01)
    sys.exit(f"no telemetry of step {step} within 30 s")

ctx.step_done(0, samples=1)
before = peak_after(1)
held = b"x" * (256 * 1024 * 1024)  # filled, so every page is resident
after = peak_after(2)
ctx.finish(done=1.0)
print(json.dumps({"before": before, "after": after}))
"""


def test_a_ranks_peak_rss_in_its_heartbeat_grows_after_it_allocates(tmp_path: Path) -> None:
    """A real process in a job: its heartbeat file's peak memory (RSS, without CUDA) before and after
    it allocates and fills 256 MiB."""
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    env = {**os.environ, METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"), HEARTBEAT_S_ENV: "0.05"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    peaks = json.loads(done.stdout)
    (before, kind_before), (after, kind_after) = peaks["before"], peaks["after"]
    assert kind_before == kind_after == "rss"
    assert after - before >= 256 * 1024 * 1024 * 0.9


@pytest.mark.skipif(not torch_cuda_available(), reason="no CUDA device: the CUDA peak is read where one is")
def test_with_cuda_in_use_the_peak_is_cudas_peak_allocation() -> None:
    import torch

    held = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    peak, kind = peak_memory()
    assert kind == "cuda"
    assert peak is not None and peak >= held.numel() and peak == torch.cuda.max_memory_allocated()


def test_a_heartbeat_without_telemetry_writes_no_key_and_unknown_keys_are_read_past(tmp_path: Path) -> None:
    """Files of scripts that never call step_done stay as they were; a newer runtime's extra keys do
    not make an orchestrator lose a rank's heartbeat (it would look hung)."""
    beat = Heartbeat(tmp_path, rank=0, interval_s=3600).start()
    beat.finish()
    raw = json.loads((tmp_path / "rank-0.json").read_text())
    assert "telemetry" not in raw
    raw["from_a_newer_runtime"] = 1
    raw["telemetry"] = {**asdict(StepTelemetry(3, 2, 0.5, 8.0, None, 1024, "rss", 100.0)), "newer": True}
    (tmp_path / "rank-0.json").write_text(json.dumps(raw))
    [read] = read_progress(tmp_path)
    assert read.telemetry == StepTelemetry(3, 2, 0.5, 8.0, None, 1024, "rss", 100.0)


def test_ctx_step_done_in_a_job_publishes_every_ranks_telemetry_with_its_heartbeat(tmp_path: Path) -> None:
    env = {METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"), RANK_ENV: "1", HEARTBEAT_S_ENV: "0.05"}
    ctx = runtime.init({}, environ=env)
    for step in range(3):
        ctx.step_done(step, samples=2, tokens=10)
    ctx.finish()  # the last beat carries the last window
    [beat] = read_progress(tmp_path / "progress")
    assert beat.rank == 1 and beat.step == 2 and beat.telemetry is not None
    assert (beat.telemetry.step, beat.telemetry.steps) == (2, 2)
    assert beat.telemetry.tokens_per_s == pytest.approx(5 * (beat.telemetry.samples_per_s or 0))


STRAGGLER_SCRIPT = """
import time
import torch
import torch.distributed as dist
from tunepod import runtime, world

ctx = runtime.init({})
torch.set_num_threads(1)
dist.init_process_group("gloo")
compute_s = 0.08 if ctx.rank == 1 else 0.005  # rank 1 is the straggler
signal = torch.zeros(1)
for step in range(13):
    end = time.perf_counter() + compute_s
    while time.perf_counter() < end:  # work on the CPU
        pass
    dist.all_reduce(signal)  # every rank meets the slow one here, as DDP does each step
    ctx.step_done(step, samples=1)
ctx.finish(done=1.0)
dist.barrier()
dist.destroy_process_group()
"""


def test_a_straggler_rank_stands_out_by_cpu_busy_where_step_times_match(tmp_path: Path) -> None:
    """A real 2-rank gloo job in lockstep (an all-reduce every step) where rank 1 computes 80 ms a
    step and rank 0 5 ms: both ranks' step times are the slow rank's, but rank 0 waits off the CPU in
    the collective, so rank 1's CPU busy stands out."""
    from ports import free_port

    script = tmp_path / "straggler.py"
    script.write_text(STRAGGLER_SCRIPT)
    port = str(free_port())
    base = {**os.environ, METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"), HEARTBEAT_S_ENV: "3600"}
    base |= {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**base, RANK_ENV: str(rank), "LOCAL_RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for process in ranks:
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
    fast, slow = (beat.telemetry for beat in read_progress(tmp_path / "progress"))  # the last beats
    assert fast is not None and slow is not None and fast.steps == slow.steps == 12
    # Lockstep: one step time for both (the slow rank's), so step time cannot tell them apart.
    assert max(fast.step_time_s, slow.step_time_s) / min(fast.step_time_s, slow.step_time_s) < 1.3
    assert fast.cpu_busy is not None and slow.cpu_busy is not None
    # A ratio, not a margin: on a loaded machine the slow rank gets less CPU than it asks for, while
    # the fast rank's wait stays off the CPU whatever the load.
    assert slow.cpu_busy > 3 * fast.cpu_busy, (fast, slow)
