"""The simulated machine room: simulated threads in simulated processes on simulated hosts, one clock,
and a scheduler that a seed drives.

Every simulated thread is a greenlet. Exactly one runs at a time, and it runs until it reaches a
*yield point*: a call through one of tunepod's seams (``tunepod.world``: a clock reading, a sleep, a
file lock, a condition; a backend, storage or tracking call; a record written in a job dir). There
the scheduler takes over and picks, with the seed's choices, which runnable thread goes on (or
whether a fault strikes first). So one seed fixes every interleaving, and a run replays exactly.

Time is simulated: it stands still while a thread runs from one yield point to the next, and jumps to
the next wake-up once every thread waits (a sleep, a timeout, a job's next step, a call under way).
A call to the world outside takes time (``Scheduler.takes``): a backend's API call, an Optuna or
MLflow request, a record written, a process starting each last a duration drawn from the seed's
``Latency`` profile, during which the calling thread waits, keeping every lock it holds, while the
other threads run on. Each host has a wall clock that may be skewed and may jump; monotonic clocks
never jump. A crashed process's threads are never run again and its file locks are freed, as the
kernel frees a SIGKILLed process's ``flock``s; a stalled process is not run until its stall ends
(wherever its threads stopped, a lock held or not), while time goes on for everyone else.

*Lazy polls* (``Scheduler.lazy_polls``, for a quality run without faults): a poll's wait
(``poll_wait``: a driver idling between two looks at its job, the tuner's loop between two plans)
names what its next look reads (a job dir, the study); until one of those changes (``changed``) its
timeout is put off, and once one does it wakes at the first tick of its period after the change,
as it would have, every look between having found nothing new (what those looks did besides:
``simulation.quality``).
"""

from __future__ import annotations

import contextlib
import enum
import math
import shutil
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from greenlet import greenlet

from simulation.choices import Choices
from simulation.trace import Trace
from tunepod import world

T = TypeVar("T")
A = TypeVar("A")

Span = tuple[float, float]
"""How long one kind of call takes: the fastest and the slowest, in seconds."""

_INSTANT: Span = (0.0, 0.0)
TRIALS_CHANGED = "the study's trials"
"""What the tuner's loop reads between two plans, for a lazy poll: a trial created, or its state,
parameters or attributes written (``Scheduler.changed`` on each such write). Not a reported value: a
plan reads those only to rank parked trials for free slots, and a slot frees as its driver returns,
which wakes the loop at once."""


@dataclass(frozen=True)
class Latency:
    """A seed's latency profile: how long each kind of call to the world outside takes (each call a
    duration drawn uniformly from its kind's span). The default takes no time at all."""

    optuna: Span = _INSTANT
    """An Optuna storage request (a round trip to its database)."""
    mlflow: Span = _INSTANT
    """An MLflow request (a round trip to the tracking server)."""
    api: Span = _INSTANT
    """A backend's API call: a Slurm command, a Kubernetes request, a SageMaker request (and again its
    reply)."""
    syscall: Span = _INSTANT
    """A call to the local machine's kernel: a fork+exec of a job's wrapper, a signal."""
    write: Span = _INSTANT
    """A record written atomically (a temporary file, its fsync, a rename)."""
    process_start: Span = _INSTANT
    """From a job's process created to its program's first line (exec, imports, the runtime's setup)."""
    copy: Span = _INSTANT
    """One file of a checkpoint step copied from another job's folder (PBT's copy of a donor's step, a
    large state): drawn apart, in PBT's seeds only (``scenario._with_slow_copies``)."""

    def describe(self) -> str:
        spans = [(kind.name, getattr(self, kind.name)) for kind in fields(self)]
        spans = [(name, span) for name, span in spans if name != "copy" or span != _INSTANT]
        return "latency: " + ", ".join(f"{name} {_ms(low)}-{_ms(high)}" for name, (low, high) in spans)


def _ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.1f}s"
    ms = seconds * 1000
    return f"{ms:.0f}ms" if ms >= 10 else f"{ms:.2g}ms"


class SimulationError(Exception):
    """The simulation itself cannot go on (a deadlock, a thread that takes a lock it holds)."""


class TornDown(BaseException):
    """Raised into the threads left over when a seed's world is torn down, so their stacks unwind."""


@dataclass
class Host:
    """A machine: its wall clock (true time + ``skew_s``), its boot and its PID namespace."""

    name: str
    boot_id: str
    pid_namespace: str
    skew_s: float = 0.0


class State(enum.Enum):
    RUNNABLE = "runnable"
    BLOCKED = "blocked"
    DONE = "done"


class Task:
    """One simulated thread of a simulated process."""

    def __init__(self, sim: Scheduler, process: Process, name: str, target: Callable[[], object]) -> None:
        self.sim = sim
        self.process = process
        self.name = name
        self.state = State.RUNNABLE
        self.wake_at: float | None = None
        self.woken = False
        self.waiting_for = ""
        self.error: BaseException | None = None
        self.polling: _Poll | None = None
        """The lazy poll this thread waits in, if it does."""
        self.glet = greenlet(lambda: self._main(target), parent=sim.main)

    def _main(self, target: Callable[[], object]) -> None:
        try:
            target()
        except TornDown:
            pass
        except BaseException as exc:  # a thread that dies takes its exception with it
            self.error = exc
            self.sim.thread_died(self, exc)
        self.state = State.DONE

    def __repr__(self) -> str:
        return f"{self.process.name}/{self.name}"


class Process:
    """A simulated process: its threads, its identity, and its per-process singletons."""

    def __init__(self, sim: Scheduler, name: str, host: Host, pid: int) -> None:
        self.sim = sim
        self.name = name
        self.host = host
        self.pid = pid
        self.start_ticks = int(sim.now * 100)
        self.alive = True
        self.stalled_until = -math.inf
        self.locals: dict[str, object] = {}
        self.tasks: list[Task] = []

    @property
    def identity(self) -> world.ProcessId:
        host = self.host
        return world.ProcessId(host.name, self.pid, self.start_ticks, host.boot_id, host.pid_namespace)

    def spawn(self, name: str, target: Callable[[], object]) -> Task:
        task = Task(self.sim, self, name, target)
        self.tasks.append(task)
        self.sim.add(task)
        return task

    def runs(self, now: float) -> bool:
        return self.alive and now >= self.stalled_until

    @property
    def done(self) -> bool:
        """Every thread has ended (a process whose main thread returned still runs its others)."""
        return all(task.state is State.DONE for task in self.tasks)

    def __repr__(self) -> str:
        return self.name


class Scheduler:
    """Runs the simulated threads, one at a time, as ``choices`` decides; see the module docstring."""

    def __init__(
        self, choices: Choices, trace: Trace, *, start_time: float, latency: Latency = Latency()
    ) -> None:
        self.choices = choices
        self.latency = latency
        self.trace = trace
        self.now = start_time
        self.main = greenlet.getcurrent()
        self.tasks: list[Task] = []
        self._live: list[Task] = []
        """``tasks`` of live processes, in the same order: the only ones that may run again (a run
        ends with hundreds of killed jobs' threads, which every step would otherwise look at)."""
        self.current: Task | None = None
        self.steps = 0
        self.locks = FileLocks(self)
        self.on_thread_death: Callable[[Task, BaseException], None] | None = None
        self.after_step: Callable[[Task], None] | None = None
        """Called after each step with the thread that ran: a fault (a crash, a stall, a clock jump)
        may strike its process there, where its thread stopped, whatever locks it holds."""
        self.tearing_down = False
        self.lazy_polls = False
        """Whether a poll's timeout waits for a change of what it reads (see the module docstring)."""
        self._pollers: dict[Task, None] = {}
        self._pids = 100

    # ------------------------------------------------------------------------------ the machine room

    def start_process(self, name: str, host: Host) -> Process:
        self._pids += 1 + self.choices.integer(0, 3)
        process = Process(self, name, host, self._pids)
        self.trace.event(self.now, "process", f"{name} started (pid {process.pid} on {host.name})")
        return process

    def add(self, task: Task) -> None:
        self.tasks.append(task)
        if task.process.alive:
            self._live.append(task)

    def _ended(self, process: Process) -> None:
        process.alive = False
        self._live = [task for task in self._live if task.process is not process]
        self.locks.release_all_of(process)

    def crash(self, process: Process, why: str) -> None:
        """SIGKILL: its threads never run again; its file locks are freed."""
        if not process.alive:
            return
        self._ended(process)
        self.trace.event(self.now, "fault", f"{process.name} killed ({why})")

    def exit(self, process: Process, why: str) -> None:
        """The process ends by itself (its main thread returned, its program exited)."""
        if not process.alive:
            return
        self._ended(process)
        self.trace.event(self.now, "process", f"{process.name} exits ({why})")

    def stall(self, process: Process, seconds: float, why: str = "") -> None:
        process.stalled_until = max(process.stalled_until, self.now + seconds)
        self.trace.event(self.now, "fault", f"{process.name} stalls for {seconds:.1f}s{why}")

    def starts_late(self, process: Process, span: Span) -> None:
        """A new process whose program begins a drawn while later (``Latency.process_start``): it
        exists (its pid is there, its backend counts it running) and does nothing yet."""
        seconds = self._duration(span)
        if seconds > 0:
            process.stalled_until = max(process.stalled_until, self.now + seconds)

    def thread_died(self, task: Task, exc: BaseException) -> None:
        self.trace.event(self.now, "thread", f"{task} died: {type(exc).__name__}: {exc}")
        if self.on_thread_death is not None and task.process.alive:
            self.on_thread_death(task, exc)

    # ------------------------------------------------------------------------------ from a thread

    @property
    def task(self) -> Task:
        assert self.current is not None, "a seam of the simulated world was called outside a thread"
        return self.current

    @property
    def process(self) -> Process:
        return self.task.process

    def pause(self, what: str) -> None:
        """A yield point: another thread may run (or a fault strike) before this one goes on."""
        if self.tearing_down:
            raise TornDown()
        task = self.task
        task.waiting_for = what
        self.main.switch()

    def block(self, until: float | None, what: str) -> bool:
        """Wait until ``wake`` (True) or until true time ``until`` (False)."""
        if self.tearing_down:
            raise TornDown()
        task = self.task
        task.state, task.wake_at, task.woken, task.waiting_for = State.BLOCKED, until, False, what
        self.main.switch()
        return task.woken

    def takes(self, what: str, span: Span) -> None:
        """A call that takes a drawn time out of ``span``: a yield point, after which the calling
        thread waits that long (simulated time passes, the other threads run) keeping every lock it
        holds, as a thread blocked in a request does. A fault may strike its process meanwhile."""
        seconds = self._duration(span)
        if seconds <= 0:
            self.pause(what)
        else:
            self.block(self.now + seconds, what)

    def _duration(self, span: Span) -> float:
        low, high = span
        return self.choices.uniform(low, high) if high > 0 else 0.0

    def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            self.pause("sleep(0)")
        else:
            self.block(self.now + seconds, f"sleep({seconds:g})")

    def poll_wait(self, seconds: float, reads: Collection[str], what: str) -> bool:
        """A poll's wait: until ``wake`` (True) or ``seconds`` have passed (False). With lazy polls,
        its timeout comes at the first tick of ``seconds`` after a change of what it ``reads``."""
        if not self.lazy_polls:
            return self.block(self.now + seconds, what)
        task = self.task
        task.polling = _Poll(self.now, seconds, frozenset(reads))
        self._pollers[task] = None
        try:
            return self.block(None, what)
        finally:
            task.polling = None
            del self._pollers[task]

    def changed(self, what: str) -> None:
        """What polls read as ``what`` changed: each lazy poll of it wakes at its next tick."""
        for task in self._pollers:
            poll = task.polling
            if (
                poll is not None
                and task.state is State.BLOCKED
                and task.wake_at is None
                and what in poll.reads
            ):
                task.wake_at = poll.tick_after(self.now)

    def wake(self, task: Task) -> None:
        if task.state is State.BLOCKED:
            task.state, task.wake_at, task.woken = State.RUNNABLE, None, True

    # ------------------------------------------------------------------------------ the loop

    def step(self) -> bool:
        """Run one thread up to its next yield point; False once no thread will ever run again."""
        runnable = [
            task for task in self._live if task.state is State.RUNNABLE and task.process.runs(self.now)
        ]
        if not runnable:
            return self._advance_time()
        task = runnable[0] if len(runnable) == 1 else self.choices.pick(runnable)
        self.current = task
        try:
            task.glet.switch()
        finally:
            self.current = None
        self.steps += 1
        if task.state is State.DONE:
            self.tasks.remove(task)
            if task.process.alive:
                self._live.remove(task)
        elif self.after_step is not None:
            self.after_step(task)
        return True

    def _advance_time(self) -> bool:
        wakes = [
            task.wake_at for task in self._live if task.state is State.BLOCKED and task.wake_at is not None
        ]
        wakes += [
            task.process.stalled_until
            for task in self._live
            if task.state is State.RUNNABLE and task.process.stalled_until > self.now
        ]
        if not wakes:
            return False
        self.now = max(self.now, min(wakes))
        for task in self._live:
            if task.state is State.BLOCKED and task.wake_at is not None and task.wake_at <= self.now:
                task.state, task.wake_at = State.RUNNABLE, None
        return True

    def teardown(self) -> None:
        """Unwind every thread left suspended (crashed processes' too): their ``finally`` blocks run
        against a world that refuses to wait or yield (``TornDown``), and nothing they do is looked at
        any more. A greenlet left alive would be unwound by the garbage collector at some later
        moment, in whatever world is installed then: those are kept, and named."""
        self.tearing_down = True
        for task in list(self.tasks):
            self.current = task
            try:
                with contextlib.suppress(TornDown):
                    task.glet.throw(TornDown())
            finally:
                self.current = None
        undead = [task for task in self.tasks if not task.glet.dead]
        _GRAVEYARD.extend(task.glet for task in undead)
        self.tasks.clear()
        self._live.clear()
        if undead:
            raise SimulationError(f"threads that would not unwind at teardown: {undead}")


@dataclass(frozen=True)
class _Poll:
    since: float
    period: float
    reads: frozenset[str]

    def tick_after(self, moment: float) -> float:
        """The first tick at or after ``moment`` (and after ``since``), summed tick by tick as a
        loop of waits would reach it."""
        tick = self.since + self.period
        while tick < moment:
            tick += self.period
        return tick


# Greenlets that refused to unwind: kept referenced, so the garbage collector never resumes them.
_GRAVEYARD: list[greenlet] = []


class FileLocks:
    """``flock`` as the kernel does it: one holder per path, waiters queue, a dead holder's locks are
    freed. Each call is its own open file, so a thread taking a lock it holds would wait for itself:
    that is reported as the bug it is."""

    def __init__(self, sim: Scheduler) -> None:
        self.sim = sim
        self._holders: dict[str, Task] = {}
        self._since: dict[str, float] = {}
        self._waiters: dict[str, deque[Task]] = {}

    @contextlib.contextmanager
    def hold(self, path: Path, *, blocking: bool) -> Iterator[bool]:
        key = str(path)
        sim = self.sim
        sim.pause(f"flock {path.name}")
        me = sim.task
        while key in self._holders:
            if self._holders[key] is me:
                raise SimulationError(
                    f"{me} takes the lock of {path} it holds already: it would wait forever"
                )
            if not blocking:
                yield False
                return
            self._waiters.setdefault(key, deque()).append(me)
            sim.block(None, f"flock {path.name}")
        self._holders[key] = me
        self._since[key] = sim.now
        try:
            yield True
        finally:
            if self._holders.get(key) is me:
                self._release(key)

    def held_by(self, path: Path) -> Process | None:
        holder = self._holders.get(str(path))
        return holder.process if holder is not None else None

    def held_since(self, path: Path) -> float | None:
        """When the holder of ``path``'s lock took it; None while nobody holds it."""
        return self._since.get(str(path)) if str(path) in self._holders else None

    def release_all_of(self, process: Process) -> None:
        for key in [key for key, task in self._holders.items() if task.process is process]:
            self._release(key)

    def _release(self, key: str) -> None:
        del self._holders[key]
        for waiter in self._waiters.pop(key, deque()):
            self.sim.wake(waiter)


# ---------------------------------------------------------------------------------- thread primitives


class SimLock:
    """``threading.Lock`` (or ``RLock``) of the simulated world."""

    def __init__(self, sim: Scheduler, *, reentrant: bool = False) -> None:
        self.sim = sim
        self.reentrant = reentrant
        self.owner: Task | None = None
        self.depth = 0
        self._waiters: deque[Task] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = self.sim.task
        if self.owner is me and self.reentrant:
            self.depth += 1
            return True
        if self.owner is me:
            raise SimulationError(f"{me} acquires a lock it holds: it would wait forever")
        deadline = None if timeout is None or timeout < 0 else self.sim.now + timeout
        while self.owner is not None:
            if not blocking or (deadline is not None and self.sim.now >= deadline):
                return False
            self._waiters.append(me)
            self.sim.block(deadline, "lock")
            with contextlib.suppress(ValueError):
                self._waiters.remove(me)
        self.owner, self.depth = me, 1
        return True

    def release(self) -> None:
        assert self.owner is self.sim.task, "a lock released by a thread that does not hold it"
        self.depth -= 1
        if self.depth == 0:
            self.owner = None
            if self._waiters:
                self.sim.wake(self._waiters.popleft())

    def release_all(self) -> int:
        depth, self.depth = self.depth, 1
        self.release()
        return depth

    def reacquire(self, depth: int) -> None:
        self.acquire()
        self.depth = depth

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class SimCondition:
    """``threading.Condition`` (over an RLock, as its default) of the simulated world."""

    def __init__(self, sim: Scheduler) -> None:
        self.sim = sim
        self.lock = SimLock(sim, reentrant=True)
        self._waiters: list[Task] = []

    def __enter__(self) -> bool:
        return self.lock.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        me = self.sim.task
        depth = self.lock.release_all()
        self._waiters.append(me)
        try:
            until = None if timeout is None else self.sim.now + max(0.0, timeout)
            return self.sim.block(until, "condition")
        finally:
            if me in self._waiters:
                self._waiters.remove(me)
            self.lock.reacquire(depth)

    def wait_for(self, predicate: Callable[[], T], timeout: float | None = None) -> T:
        deadline = None if timeout is None else self.sim.now + timeout
        result = predicate()
        while not result:
            remaining = None if deadline is None else deadline - self.sim.now
            if remaining is not None and remaining <= 0:
                break
            self.wait(remaining)
            result = predicate()
        return result

    def notify_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for task in waiters:
            self.sim.wake(task)


class SimEvent:
    """``threading.Event`` of the simulated world."""

    def __init__(self, sim: Scheduler) -> None:
        self.sim = sim
        self._set = False
        self._waiters: list[Task] = []

    def set(self) -> None:
        self._set = True
        waiters, self._waiters = self._waiters, []
        for task in waiters:
            self.sim.wake(task)

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        me = self.sim.task
        self._waiters.append(me)
        self.sim.block(None if timeout is None else self.sim.now + max(0.0, timeout), "event")
        if me in self._waiters:
            self._waiters.remove(me)
        return self._set

    def poll_wait(self, seconds: float, reads: Collection[str]) -> bool:
        """``wait(seconds)`` as a poll's wait (``Scheduler.poll_wait``)."""
        if self._set:
            return True
        me = self.sim.task
        self._waiters.append(me)
        self.sim.poll_wait(max(0.0, seconds), reads, "event")
        if me in self._waiters:
            self._waiters.remove(me)
        return self._set


# ---------------------------------------------------------------------------------- the world


@dataclass
class Entropy:
    """Random ids (submission ids, lease owners): drawn from the seed, never from a decision."""

    state: int
    counter: int = field(default=0)

    def token_hex(self, nbytes: int) -> str:
        self.counter += 1
        value = (self.state * 1_000_003 + self.counter * 2_654_435_761) % (1 << (8 * nbytes))
        return f"{value:0{2 * nbytes}x}"


class SimWorld:
    """``tunepod.world.World`` over the scheduler: what the real code sees while a seed runs."""

    def __init__(self, sim: Scheduler, entropy: Entropy, *, clock_yields: bool = True) -> None:
        self.sim = sim
        self.entropy = entropy
        self.torn_down = False
        self.clock_yields = clock_yields
        """Whether reading a clock is a yield point (where another thread may run, or a fault strike,
        between two readings). Without faults, the interleavings it adds only cost time."""

    def _check(self) -> None:
        if self.torn_down:
            raise TornDown()

    def time(self) -> float:
        self._check()
        if self.clock_yields:
            self.sim.pause("time()")
        return self.sim.now + self.sim.process.host.skew_s

    def monotonic(self) -> float:
        self._check()
        if self.clock_yields:
            self.sim.pause("monotonic()")
        return self.sim.now + 1000.0 * self.sim.process.pid

    def sleep(self, seconds: float) -> None:
        self._check()
        self.sim.sleep(seconds)

    def lock(self) -> world.Lock:
        return SimLock(self.sim)

    def rlock(self) -> world.Lock:
        return SimLock(self.sim, reentrant=True)

    def condition(self) -> world.Condition:
        return SimCondition(self.sim)

    def event(self) -> world.Event:
        return SimEvent(self.sim)

    def start_thread(self, target: Callable[[], object], name: str) -> None:
        self._check()
        self.sim.process.spawn(name, target)

    def wait_any(self, futures: Collection[Future[T]], timeout: float | None) -> list[Future[T]]:
        self._check()
        done = [future for future in futures if future.done()]
        if done or timeout == 0:
            return done
        me = self.sim.task
        waiting = [True]

        def wake(_: Future[Any]) -> None:
            if waiting[0]:
                self.sim.wake(me)

        for future in futures:
            future.add_done_callback(wake)
        try:
            if timeout is None:
                self.sim.block(None, "futures")
            else:  # the tuner's loop between two plans
                self.sim.poll_wait(timeout, (TRIALS_CHANGED,), "futures")
        finally:
            waiting[0] = False
        return [future for future in futures if future.done()]

    def map_concurrently(self, call: Callable[[A], T], items: Sequence[A], max_threads: int) -> list[T]:
        """One after another: the calls' concurrency is a backend's speed, not the loop's logic."""
        self._check()
        return [call(item) for item in items]

    def file_lock(self, path: Path, *, blocking: bool = True) -> contextlib.AbstractContextManager[bool]:
        self._check()
        return self.sim.locks.hold(path, blocking=blocking)

    def token_hex(self, nbytes: int) -> str:
        return self.entropy.token_hex(nbytes)

    def process_local(self, key: str, make: Callable[[], T]) -> T:
        local = self.sim.process.locals
        if key not in local:
            local[key] = make()
        return local[key]  # type: ignore[return-value]

    def this_process(self) -> world.ProcessId:
        return self.sim.process.identity

    def is_gone(self, process: world.ProcessId) -> bool:
        me = self.this_process()
        if not me.shares_pids_with(process):
            return False
        return not any(task.process.alive and task.process.identity == process for task in self.sim.tasks)

    def copy_file(self, source: str, target: str) -> object:
        """The file is copied at once (once open, it copies whole, pruned or not, as on Linux), then
        its transfer takes a drawn time (``Latency.copy``): a yield point where the donor's job may
        save and prune the step being copied, whose next files then fail to open. Where copies are
        instant (every seed but some of PBT's), it is no yield point, as before the seam."""
        self._check()
        copied = shutil.copy2(source, target)
        if self.sim.latency.copy[1] > 0:
            self.sim.takes("a checkpoint file copied", self.sim.latency.copy)
        return copied
