"""The local stack's runner: ``tunepod run`` without paying for its imports on every run.

A new ``tunepod run`` spends seconds importing Prefect, MLflow and Optuna before it does anything (3.5-4 s
on two cores, most of the fixed cost a run has on top of its jobs). ``tunepod up`` therefore starts one
process that has imported them once (``python -m flows.runner``, which runs ``Runner`` here) and forks
it for each run: the forked child takes the caller's command, environment, working directory,
``sys.path`` and standard streams, and runs ``tunepod run`` in-process exactly as the caller would have.
The caller (``forward_run``) passes its stdin, stdout and stderr over a Unix socket (``SCM_RIGHTS``),
forwards the signals it gets (Ctrl-C, ``kill``) to the child, and exits with the child's exit status.
If the caller is killed (its socket closes), the runner SIGKILLs the child's process group: a run dies
with its ``tunepod run`` as it does without the runner. Children start sessions of their own, so
stopping the runner (``tunepod down``) leaves runs in flight alone, like the stack's other services.

The runner answers only when forking is the same as running in-process; otherwise it refuses with the
reason and the caller runs in its own process (slower, same result):

- the Prefect and MLflow variables of the caller's environment differ from the runner's (Prefect reads
  its settings once, at import: a child must not run with settings that are not the caller's);
- a source file of tunepod, ``flows`` or ``tasks`` that the runner imported has changed since (a
  child would run the old code); restart the runner to pick it up;
- the stack's Prefect server does not answer (the caller then starts a temporary one, as always);
- the request is too large, or comes from another user (checked with ``SO_PEERCRED``).

Messages are JSON, one per ``SOCK_SEQPACKET`` packet (boundaries kept by the kernel). The socket is in
Linux's abstract namespace, named after the stack's home folder, so no path length limit or stale file
applies. ``TUNEPOD_RUNNER=off`` makes ``tunepod run`` run in its own process. Never imports Prefect.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import selectors
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunepod.spec.loader import shown_override

logger = logging.getLogger(__name__)

RUNNER_ENV = "TUNEPOD_RUNNER"
"""``off`` (or ``0``, ``false``): ``tunepod run`` never asks the runner. Set in each child, so a run the
runner started never forwards itself."""
SHARED_PREFIXES = ("PREFECT_", "MLFLOW_")
"""Variables read at import by the modules the runner has loaded: the caller's must equal the runner's."""
MAX_MESSAGE = 128 * 1024
"""Largest request (argv, environment, sys.path) the runner takes; a larger one runs in its own process."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STDIO = 3
_ACCEPT_TIMEOUT_S = 5.0
#: How long a caller waits for the runner's answer (a health check of the Prefect server, a fork) before
#: it runs the command itself; the runner kills a child whose caller left.
_ANSWER_TIMEOUT_S = 30.0


def runner_address(home: Path) -> bytes:
    """The runner's socket name for the stack in ``home`` (abstract namespace: a leading NUL byte)."""
    digest = hashlib.sha256(str(Path(home).expanduser().resolve()).encode()).hexdigest()[:24]
    return b"\0tunepod-runner-" + digest.encode()


def runner_disabled(environ: Mapping[str, str]) -> bool:
    return environ.get(RUNNER_ENV, "").strip().lower() in ("off", "0", "false", "no")


def _send(conn: socket.socket, message: Mapping[str, Any]) -> None:
    conn.send(json.dumps(message).encode())


def _receive(conn: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer has closed (or sent something that is not a message)."""
    return _parsed(conn.recv(MAX_MESSAGE))


def _parsed(data: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(data) if data else None
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


# ---------------------------------------------------------------------------------------------- caller


def ping(home: Path, timeout_s: float = 2.0) -> int | None:
    """The pid of the runner of the stack in ``home`` when it answers, else None."""
    try:
        with _connect(home, timeout_s) as conn:
            _send(conn, {"ping": True})
            answer = _receive(conn)
    except OSError:
        return None
    return int(answer["pong"]) if answer and "pong" in answer else None


def _connect(home: Path, timeout_s: float | None) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(timeout_s)
    try:
        conn.connect(runner_address(home))
    except OSError:
        conn.close()
        raise
    return conn


def say_on_stderr(message: str) -> None:
    """One line to this process's stderr in one ``write``: ``print`` writes the text and its newline
    separately (stderr writes through), and a forwarded child writing to the same stderr in between
    would glue its line to ours."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def forward_run(home: Path, argv: Sequence[str], say: Callable[[str], None]) -> int | None:
    """Have the stack's runner run ``tunepod <argv>`` with this process's environment, working folder and
    standard streams; return its exit status (negative: the signal that killed it). None when the run
    must happen in this process instead: no runner, ``TUNEPOD_RUNNER=off``, or a refusal (``say``
    gets its reason). With no ``PREFECT_API_URL`` set, the run goes to the stack's Prefect server."""
    if runner_disabled(os.environ):
        return None
    try:
        conn = _connect(home, _ACCEPT_TIMEOUT_S)
    except OSError:
        return None  # no runner for this stack: the normal case for a stack started before it had one
    # Held from the request on: the runner may start the child before its answer arrives, and a signal
    # between that start and the forwarding handlers would kill this process and leave the run alone.
    with conn, _signals_held():
        request = {"argv": list(argv), "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path}
        try:
            socket.send_fds(conn, [json.dumps(request).encode()], list(range(_STDIO)))
            conn.settimeout(_ANSWER_TIMEOUT_S)
            answer = _receive(conn)
        except OSError as exc:
            say(f"the stack's runner did not take the run ({exc}); running it in this process")
            os.environ[RUNNER_ENV] = "off"
            return None
        if answer is None or "refused" in answer:
            reason = "it closed the connection" if answer is None else answer["refused"]
            say(f"the stack's runner did not take the run: {reason}; running it in this process")
            os.environ[RUNNER_ENV] = "off"  # asked once: the command line does not ask again
            return None
        if not os.environ.get("PREFECT_API_URL"):
            say(f"using the Prefect server of the local stack: {answer['api']}")
        say(f"running in the local stack's runner (process {answer['started']})")
        conn.settimeout(None)
        with _forwarding_signals(conn):
            return _wait_for_exit(conn, int(answer["started"]), say)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Block ``FORWARDED_SIGNALS`` (they wait, pending) until the block ends or forwarding starts.
    Blocked for this thread: ``forward_run`` runs before ``tunepod run`` starts any other thread."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one still pending acts now


@contextlib.contextmanager
def _forwarding_signals(conn: socket.socket) -> Iterator[None]:
    """Send each signal this process gets to the runner's child instead of acting on it (one that
    came while they were held goes as soon as the handlers are in place)."""

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            _send(conn, {"signal": signum})

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _wait_for_exit(conn: socket.socket, pid: int, say: Callable[[str], None]) -> int:
    answer = _receive(conn)
    if answer is not None and "exit" in answer:
        return int(answer["exit"])
    # The runner itself went away (stopped or killed); the run is a session of its own and goes on,
    # writing here still, but nothing can report how it ends.
    say(
        f"lost the stack's runner while the run (process {pid}) was going on; it keeps running and "
        "writing here, but its exit status cannot reach this command: exit 1"
    )
    return 1


def exit_like(status: int) -> int:
    """Make this process end as the child did: a signal kills it with that signal; returns the exit
    code to use otherwise (and when the signal did not end this process)."""
    if status >= 0:
        return status
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
    return 128 - status


# ---------------------------------------------------------------------------------------------- runner


@dataclass(frozen=True)
class SourceSnapshot:
    """Modification times of the runner's own source files when it started, to refuse runs once any
    of them changed (the child would run the old code)."""

    mtimes: dict[str, int]

    @classmethod
    def of_loaded_modules(cls, roots: Sequence[Path]) -> SourceSnapshot:
        """Every loaded module whose file is under one of ``roots``."""
        resolved = [root.resolve() for root in roots]
        files = {
            str(path)
            for module in list(sys.modules.values())
            if (path := _module_file(module)) is not None and any(path.is_relative_to(r) for r in resolved)
        }
        return cls({name: _mtime(name) for name in files})

    def first_change(self) -> str | None:
        """A file that changed (or went away) since the snapshot, or None."""
        return next((name for name, mtime in self.mtimes.items() if _mtime(name) != mtime), None)


def _module_file(module: object) -> Path | None:
    name = getattr(module, "__file__", None)
    return Path(name).resolve() if isinstance(name, str) else None


def _mtime(name: str) -> int:
    try:
        return os.stat(name).st_mtime_ns
    except OSError:
        return -1


@dataclass
class _Run:
    pid: int
    conn: socket.socket
    pidfd: int


@dataclass
class Runner:
    """The fork server. ``entry(argv)`` runs in each child and ends it by raising ``SystemExit`` (a
    typer app does); ``shared_env`` are the caller's variables that must equal this process's (once
    completed with the stack's API and ``run_defaults``)."""

    home: Path
    entry: Callable[[list[str]], object]
    sources: SourceSnapshot
    stack_api: Callable[[], str | None]
    """The API URL of the stack's Prefect server when it answers (for callers that chose none)."""
    run_defaults: Mapping[str, str]
    """Variables ``tunepod run`` sets unless the caller did."""
    shared_env: dict[str, str] = field(
        default_factory=lambda: {k: v for k, v in os.environ.items() if k.startswith(SHARED_PREFIXES)}
    )
    _selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)

    def serve_forever(self) -> None:
        """Answer requests until killed. Single-threaded on purpose: a process with other threads must
        not fork (a lock one of them held would stay locked in the child)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(runner_address(self.home))
        listener.listen(64)
        self._selector.register(listener, selectors.EVENT_READ, self._accept)
        logger.info("runner %d ready for %s", os.getpid(), self.home)
        while True:
            for key, _ in self._selector.select():
                key.data(key.fileobj)

    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        conn.settimeout(_ACCEPT_TIMEOUT_S)
        try:
            self._answer(conn)
        except OSError as exc:
            logger.warning("request dropped: %s", exc)
            conn.close()

    def _answer(self, conn: socket.socket) -> None:
        """Take one connection's request: a ping, a refusal, or a forked run (which keeps ``conn``)."""
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE + 1, _STDIO)
        request = _parsed(data)
        refusal = self._refusal(request, uid, len(data), len(fds))
        if refusal is None and request is not None and not request.get("ping"):
            self._start(conn, request, fds)  # the child never comes back here
            return
        for fd in fds:
            os.close(fd)
        if refusal is None:
            _send(conn, {"pong": os.getpid()})
        else:
            logger.info("refused a request from process %d: %s", pid, refusal)
            _send(conn, {"refused": refusal})
        conn.close()

    def _refusal(self, request: dict[str, Any] | None, uid: int, size: int, fd_count: int) -> str | None:
        """Why the request cannot be served (None: it can). A run request's environment is completed
        on the way as ``tunepod run`` would complete it (``_complete_env``)."""
        if uid != os.getuid():
            return f"the runner serves user {os.getuid()} only"
        if request is None:
            return "not a request"
        if request.get("ping"):
            return None
        if size > MAX_MESSAGE:
            return f"the request is over {MAX_MESSAGE} bytes (a very large environment)"
        if fd_count != _STDIO or not isinstance(request.get("env"), dict):
            return "not a run request (argv, cwd, env, path and three standard streams)"
        return self._complete_env(request["env"]) or self._stale_or_differing(request["env"])

    def _complete_env(self, env: dict[str, str]) -> str | None:
        """Choose the stack's Prefect server for a caller that chose none, and add the run defaults,
        as ``tunepod run`` does in-process; why not, when the stack's Prefect server does not answer
        (the caller then starts a temporary server of its own, as it would without the runner)."""
        if not env.get("PREFECT_API_URL"):
            api = self.stack_api()
            if api is None:
                return "the local stack's Prefect server does not answer"
            env["PREFECT_API_URL"] = api
        for name, value in self.run_defaults.items():
            env.setdefault(name, value)
        return None

    def _stale_or_differing(self, env: Mapping[str, str]) -> str | None:
        differing = self._differing_env(env)
        if differing:
            return (
                f"{', '.join(differing)} differ from the runner's environment (Prefect and MLflow read "
                "them when imported); to use the runner, start the stack from a shell where they are set "
                "the same"
            )
        changed = self.sources.first_change()
        if changed is not None:
            return f"{changed} changed since the runner started; restart it: tunepod down && tunepod up"
        return None

    def _differing_env(self, env: Mapping[str, str]) -> list[str]:
        theirs = {k: v for k, v in env.items() if k.startswith(SHARED_PREFIXES)}
        return sorted(
            k for k in theirs.keys() | self.shared_env.keys() if theirs.get(k) != self.shared_env.get(k)
        )

    def _start(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would write this process's buffered output again
        pid = os.fork()
        if pid == 0:
            self._become_run(conn, request, fds)  # never returns: ends by SystemExit
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        pidfd = os.pidfd_open(pid)
        run = _Run(pid, conn, pidfd)
        self._selector.register(conn, selectors.EVENT_READ, lambda _: self._from_caller(run))
        self._selector.register(pidfd, selectors.EVENT_READ, lambda _: self._ended(run))
        with contextlib.suppress(OSError):  # a caller gone already: reading its connection kills the run
            _send(conn, {"started": pid, "api": request["env"]["PREFECT_API_URL"]})
        # Its --set values may hold a store URI or a credential: the log (a file, and Prefect's) shows
        # each as tunepod shows any.
        shown = " ".join(map(shown_override, request["argv"]))
        logger.info("run %d started: %s (cwd %s)", pid, shown, request["cwd"])

    def _from_caller(self, run: _Run) -> None:
        try:
            message = _receive(run.conn)
        except OSError:
            message = None
        if message is None:  # the caller is gone (killed): its run goes with it, as without the runner
            logger.info("caller of run %d closed its connection: killing the run", run.pid)
            # The group (the child leads its own session), and the child itself in case it has not
            # called setsid yet (a caller killed within moments of the start).
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(ProcessLookupError):
                    kill(run.pid, signal.SIGKILL)
            self._selector.unregister(run.conn)
            return
        signum = message.get("signal")
        if isinstance(signum, int) and signum in FORWARDED_SIGNALS:
            with contextlib.suppress(ProcessLookupError):
                os.kill(run.pid, signum)

    def _ended(self, run: _Run) -> None:
        _, status = os.waitpid(run.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        logger.info("run %d ended: %d", run.pid, code)
        self._selector.unregister(run.pidfd)
        os.close(run.pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(run.conn)
        with contextlib.suppress(OSError):
            _send(run.conn, {"exit": code})
        run.conn.close()

    def _become_run(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        """In the child: take on the caller's process state and run the command; ``entry`` ends the
        process with the command's exit status. Nothing here may return or raise into the runner's
        loop (the child would go on serving): a failure ends the child with status 1."""
        try:
            self._take_on_caller(conn, request, fds)
            self.entry(list(request["argv"]))
        except Exception:
            traceback.print_exc()
            raise SystemExit(1) from None
        # SystemExit and KeyboardInterrupt unwind to the interpreter's top, which exits as a
        # `tunepod run` would: atexit handlers (Prefect's last logs and events), then the status.
        raise SystemExit(0)

    def _take_on_caller(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        """Leave the runner's session, drop its sockets and signal handlers, and take the caller's
        streams, folder, environment and ``sys.path``."""
        os.setsid()
        for key in list(self._selector.get_map().values()):
            fileobj = key.fileobj
            if isinstance(fileobj, socket.socket):
                fileobj.close()
            elif isinstance(fileobj, int):  # a pidfd
                os.close(fileobj)
        self._selector.close()
        conn.close()
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=stream.isatty())  # type: ignore[union-attr]
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**request["env"], RUNNER_ENV: "off"})
        sys.path[:] = request["path"]
        sys.argv = ["tunepod", *request["argv"]]
