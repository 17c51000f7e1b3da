"""The seams through which the orchestrator reaches time, threads, locks, processes and chance.

The tuning loop (tuner, job drivers, leases, launchers' bookkeeping, the tracking outbox and mirrors)
reads the clocks, sleeps, starts threads, waits on locks, conditions and events, takes file locks,
draws random ids, asks whether a process is alive and copies each file of a checkpoint copied from
another job's folder only through the ``World`` installed here.
``RealWorld`` is the standard library and the kernel; the deterministic simulation
(``tests/simulation``) installs a world of its own for one seed at a time, under which the seed fixes
every interleaving of the real code, every fault and every reading of a clock.

Call the module's functions (``world.sleep(1)``, ``world.lock()``): they go to whichever world is
installed. Objects made under one world (a lock, a condition) belong to it: make them where they are
used, never at import time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import socket
import threading
import time as _time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import TracebackType
from typing import Protocol, TypeVar, cast

from tunepod.errors import TunepodError

T = TypeVar("T")
A = TypeVar("A")


class Lock(Protocol):
    """What ``threading.Lock`` and ``RLock`` offer and the code uses."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...
    def release(self) -> None: ...
    def __enter__(self) -> bool: ...
    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class Condition(Protocol):
    """What ``threading.Condition`` offers and the code uses."""

    def __enter__(self) -> bool: ...
    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def wait_for(self, predicate: Callable[[], T], timeout: float | None = None) -> T: ...
    def notify_all(self) -> None: ...


class Event(Protocol):
    """What ``threading.Event`` offers and the code uses."""

    def set(self) -> None: ...
    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class ProcessId:
    """One process, told apart from any other: a pid alone is not enough once pids are reused, nor
    once two containers (each with its own PID namespace, maybe with one hostname) run orchestrators
    with the same pid."""

    host: str
    """For people: the hostname (containers may share one, so it decides nothing)."""
    pid: int
    start_ticks: int
    """When the process started (``/proc/<pid>/stat`` field 22): with the pid, one process."""
    boot_id: str = ""
    """The kernel's boot id: equal only for processes of one machine since its last boot."""
    pid_namespace: str = ""
    """The PID namespace (``/proc/self/ns/pid``): pids can only be looked up within one."""

    def shares_pids_with(self, other: ProcessId) -> bool:
        """Whether ``other``'s pid can be looked up here: same boot of the same machine AND same PID
        namespace. Unknown (an empty field, as older records have) never counts as the same."""
        return bool(self.boot_id and self.pid_namespace) and (self.boot_id, self.pid_namespace) == (
            other.boot_id,
            other.pid_namespace,
        )


class World(Protocol):
    """Everything the orchestrator needs from outside its own state; see the module docstring."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch (may jump)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (meaningless across processes)."""
        ...

    def sleep(self, seconds: float) -> None: ...

    def lock(self) -> Lock: ...

    def rlock(self) -> Lock: ...

    def condition(self) -> Condition: ...

    def event(self) -> Event: ...

    def start_thread(self, target: Callable[[], object], name: str) -> None:
        """Run ``target`` on a daemon thread of this process."""
        ...

    def wait_any(self, futures: Collection[Future[T]], timeout: float | None) -> list[Future[T]]:
        """Wait until one of ``futures`` is done (or ``timeout`` passed); the done ones, in the order
        of ``futures`` (never a set's order, which changes from run to run)."""
        ...

    def map_concurrently(self, call: Callable[[A], T], items: Sequence[A], max_threads: int) -> list[T]:
        """``[call(item) for item in items]``, up to ``max_threads`` calls at once (round trips to a
        backend); the first exception of a call is raised."""
        ...

    def file_lock(self, path: Path, *, blocking: bool = True) -> contextlib.AbstractContextManager[bool]:
        """Hold an exclusive lock of ``path`` that other processes (and threads) respect and that is
        released when its holder dies. Yields True once held; without ``blocking``, yields False at
        once (holding nothing) when another holds it."""
        ...

    def token_hex(self, nbytes: int) -> str: ...

    def process_local(self, key: str, make: Callable[[], T]) -> T:
        """This process's one ``key`` object, made by ``make`` on first use: a per-process singleton
        (a heartbeat thread), which dies with its process."""
        ...

    def this_process(self) -> ProcessId: ...

    def is_gone(self, process: ProcessId) -> bool:
        """True only when ``process`` is certainly no longer running (it shares this process's pids
        and is not there any more); False when it runs or when that cannot be told from here."""
        ...

    def copy_file(self, source: str, target: str) -> object:
        """``shutil.copy2``: one file of a folder copied while its owner may change it (PBT's copy of a
        running donor's checkpoint step, ``shutil.copytree(..., copy_function=world.copy_file)``);
        between two files, the donor's job may save a step and prune the one being copied."""
        ...


class RealWorld:
    """The standard library and the kernel."""

    def time(self) -> float:
        return _time.time()

    def monotonic(self) -> float:
        return _time.monotonic()

    def sleep(self, seconds: float) -> None:
        _time.sleep(seconds)

    def lock(self) -> Lock:
        return threading.Lock()

    def rlock(self) -> Lock:
        return threading.RLock()

    def condition(self) -> Condition:
        return threading.Condition()

    def event(self) -> Event:
        return threading.Event()

    def start_thread(self, target: Callable[[], object], name: str) -> None:
        threading.Thread(target=target, name=name, daemon=True).start()

    def wait_any(self, futures: Collection[Future[T]], timeout: float | None) -> list[Future[T]]:
        done = _wait_futures(futures, timeout=timeout, return_when=FIRST_COMPLETED).done
        return [future for future in futures if future in done]

    def map_concurrently(self, call: Callable[[A], T], items: Sequence[A], max_threads: int) -> list[T]:
        if len(items) <= 1:
            return [call(item) for item in items]
        with ThreadPoolExecutor(min(max_threads, len(items))) as pool:
            return list(pool.map(call, items))

    @contextlib.contextmanager
    def file_lock(self, path: Path, *, blocking: bool = True) -> Iterator[bool]:
        path.parent.mkdir(parents=True, exist_ok=True)
        # One descriptor per call: the lock then excludes other threads of this process as well.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            yield _flock(fd, path, blocking=blocking)
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def token_hex(self, nbytes: int) -> str:
        return secrets.token_hex(nbytes)

    def process_local(self, key: str, make: Callable[[], T]) -> T:
        # Keyed by pid as well: a forked child has none of its parent's threads.
        slot = (os.getpid(), key)
        with _PROCESS_LOCALS_LOCK:
            if slot not in _PROCESS_LOCALS:
                _PROCESS_LOCALS[slot] = make()
            return cast(T, _PROCESS_LOCALS[slot])

    def this_process(self) -> ProcessId:
        return _own_identity(os.getpid())  # by pid: a forked child is another process

    def is_gone(self, process: ProcessId) -> bool:
        if not self.this_process().shares_pids_with(process):
            return False
        ticks = _start_ticks(process.pid, alive_only=True)
        return ticks is None or ticks != process.start_ticks

    def copy_file(self, source: str, target: str) -> object:
        return shutil.copy2(source, target)


def _flock(fd: int, path: Path, *, blocking: bool) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOLCK:
            raise
        # NFS mounted with nolock (or a server without its lock daemon): without a working lock, two
        # orchestrators could both drive one job, so refuse rather than run unlocked.
        raise TunepodError(
            f"cannot lock {path}: its filesystem does not support file locks (ENOLCK). tunepod needs "
            "them to keep one driver per trial; fix: mount the shared filesystem with locking (NFS: "
            "without 'nolock', with rpc.statd running or NFSv4; FSx for Lustre: the default 'flock' "
            "mount option), or point the spec's paths (launcher.root, study.storage) at one that has it"
        ) from exc


_PROCESS_LOCALS: dict[tuple[int, str], object] = {}
_PROCESS_LOCALS_LOCK = threading.Lock()


@cache
def _machine_and_namespace() -> tuple[str, str]:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux, or /proc hidden: no pid is ever taken for gone
        return "", ""
    return boot_id, namespace


@cache
def _own_identity(pid: int) -> ProcessId:
    boot_id, pid_namespace = _machine_and_namespace()
    return ProcessId(socket.gethostname(), pid, _start_ticks(pid) or 0, boot_id, pid_namespace)


def _start_ticks(pid: int, *, alive_only: bool = False) -> int | None:
    # Imported here: procfs is a launcher helper, and this module sits below every package.
    from tunepod.launch.procfs import read_process_stat

    stat = read_process_stat(pid)
    if stat is None or (alive_only and stat.is_dead):
        return None
    return stat.start_ticks


class _Installed(threading.local):
    """The installed world, per OS thread. A simulated seed runs all its threads as greenlets on
    the one OS thread that installed its world; any other OS thread of the process (a test's server,
    a thread another test left behind) keeps the real world, so it can neither read the seed's
    clocks nor block one of its threads: either would change the seed's run."""

    world: World = RealWorld()


_installed = _Installed()


def current() -> World:
    """The world installed now, on this OS thread."""
    return _installed.world


@contextlib.contextmanager
def installed(world: World) -> Iterator[World]:
    """Install ``world`` on this OS thread for the ``with`` block (a simulation's seed), then the one
    before again."""
    before, _installed.world = _installed.world, world
    try:
        yield world
    finally:
        _installed.world = before


def time() -> float:
    return _installed.world.time()


def monotonic() -> float:
    return _installed.world.monotonic()


def sleep(seconds: float) -> None:
    _installed.world.sleep(seconds)


def lock() -> Lock:
    return _installed.world.lock()


def rlock() -> Lock:
    return _installed.world.rlock()


def condition() -> Condition:
    return _installed.world.condition()


def event() -> Event:
    return _installed.world.event()


def start_thread(target: Callable[[], object], name: str) -> None:
    _installed.world.start_thread(target, name)


def wait_any(futures: Collection[Future[T]], timeout: float | None) -> list[Future[T]]:
    return _installed.world.wait_any(futures, timeout)


def map_concurrently(call: Callable[[A], T], items: Sequence[A], max_threads: int) -> list[T]:
    return _installed.world.map_concurrently(call, items, max_threads)


def file_lock(path: Path, *, blocking: bool = True) -> contextlib.AbstractContextManager[bool]:
    return _installed.world.file_lock(path, blocking=blocking)


def token_hex(nbytes: int) -> str:
    return _installed.world.token_hex(nbytes)


def process_local(key: str, make: Callable[[], T]) -> T:
    return _installed.world.process_local(key, make)


def this_process() -> ProcessId:
    return _installed.world.this_process()


def is_gone(process: ProcessId) -> bool:
    return _installed.world.is_gone(process)


def copy_file(source: str, target: str) -> object:
    return _installed.world.copy_file(source, target)


__all__ = [
    "Condition",
    "Event",
    "Lock",
    "ProcessId",
    "RealWorld",
    "World",
    "condition",
    "copy_file",
    "current",
    "event",
    "file_lock",
    "installed",
    "is_gone",
    "lock",
    "map_concurrently",
    "monotonic",
    "process_local",
    "rlock",
    "sleep",
    "start_thread",
    "this_process",
    "time",
    "token_hex",
    "wait_any",
]
