"""The lease protocol as a state machine (Hypothesis' stateful testing): orchestrators take, renew, act
on and release one job dir's lease while time passes, clocks jump, holders stall past the TTL and
die. Whatever the order, a fenced action never comes from a holder whose lease was taken over: the
actions on the job follow the lease's generations in order, and each comes from the holder the lease
file names.

The real ``tunepod.launch.lease`` runs against a world whose clocks and processes the rules set
(``ProtocolWorld``); renewals are a rule rather than a thread, so a stalled holder is one the rules
stop renewing. The full loop under the same faults is the simulation's (``tests/simulation``).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tunepod import world
from tunepod.launch.lease import Lease, LeaseLost, Leases, read_lease
from tunepod.launch.paths import JobPaths

T = TypeVar("T")
ACTORS = ("a", "b", "c")
TTL_S = 60.0


class ProtocolWorld(world.RealWorld):
    """Real file locks; simulated clocks, processes and threads (a started thread never runs)."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0
        self.skew = dict.fromkeys(ACTORS, 0.0)
        self.actor = "a"
        self.dead: set[str] = set()
        self.started = {name: 0 for name in ACTORS}
        self.locals: dict[str, dict[str, object]] = {name: {} for name in ACTORS}
        self.tokens = 0

    def time(self) -> float:
        return self.now + self.skew[self.actor]

    def monotonic(self) -> float:
        return self.now

    def start_thread(self, target: Callable[[], object], name: str) -> None:
        """Heartbeat threads are the ``renew`` rule here."""

    def token_hex(self, nbytes: int) -> str:
        self.tokens += 1
        return f"{self.tokens:0{2 * nbytes}x}"

    def process_local(self, key: str, make: Callable[[], T]) -> T:
        local = self.locals[self.actor]
        if key not in local:
            local[key] = make()
        return local[key]  # type: ignore[return-value]

    def this_process(self) -> world.ProcessId:
        return self._process(self.actor)

    def is_gone(self, process: world.ProcessId) -> bool:
        actor = process.host.removeprefix("host-")
        return process.pid_namespace == "pid:[shared]" and (
            actor in self.dead or process.start_ticks != self.started[actor]
        )

    def _process(self, actor: str) -> world.ProcessId:
        return world.ProcessId(f"host-{actor}", 100, self.started[actor], "boot", "pid:[shared]")


class LeaseProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="lease-protocol-"))
        self.job_dir = self.folder / "trial-0"
        self.world = ProtocolWorld()
        self._installed = contextlib.ExitStack()
        self._installed.enter_context(world.installed(self.world))
        self.leases: dict[str, Leases] = {}
        self.held: dict[str, Lease] = {}
        self.acted: list[tuple[int, str]] = []
        """(generation, actor) of every fenced action that went ahead, in order."""
        for actor in ACTORS:
            self._start(actor)

    def teardown(self) -> None:
        self._installed.close()

    @contextlib.contextmanager
    def _as(self, actor: str) -> Iterator[None]:
        self.world.actor = actor
        yield

    def _start(self, actor: str) -> None:
        self.world.started[actor] += 1
        self.world.dead.discard(actor)
        self.world.locals[actor] = {}
        with self._as(actor):
            self.leases[actor] = Leases(private_job_dirs=True, ttl_s=TTL_S)
        self.held.pop(actor, None)

    # ------------------------------------------------------------------------------ rules

    def _alive(self) -> list[str]:
        return [actor for actor in ACTORS if actor not in self.world.dead]

    def _holders(self) -> list[str]:
        return [actor for actor in sorted(self.held) if actor not in self.world.dead]

    @precondition(lambda self: self._alive())
    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        actor = data.draw(st.sampled_from(self._alive()))
        with self._as(actor):
            lease = self.leases[actor].acquire(self.job_dir)
        if lease is not None:
            self.held[actor] = lease

    @precondition(lambda self: self._holders())
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        """A holder's heartbeat beats (a stalled holder is one this rule leaves out for a while)."""
        actor = data.draw(st.sampled_from(self._holders()))
        with self._as(actor):
            self.leases[actor].renew(self.held[actor])

    @precondition(lambda self: self._holders())
    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        """A fenced action on the job (a submit, a stop, a tell) by a holder, taken over or not."""
        actor = data.draw(st.sampled_from(self._holders()))
        lease = self.held[actor]
        with self._as(actor), contextlib.suppress(LeaseLost), lease.fenced():
            current = read_lease(JobPaths(self.job_dir))
            owner = current.owner if current is not None else None
            assert owner == self.leases[actor].owner, f"{actor} acts while {owner} holds the lease"
            self.acted.append((lease.generation, actor))

    @precondition(lambda self: self._holders())
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        actor = data.draw(st.sampled_from(self._holders()))
        with self._as(actor):
            self.held.pop(actor).release()

    @rule(seconds=st.sampled_from([1.0, TTL_S / 3, TTL_S + 1, 3 * TTL_S]))
    def time_passes(self, seconds: float) -> None:
        self.world.now += seconds

    @rule(actor=st.sampled_from(ACTORS), jump=st.sampled_from([-2 * TTL_S, -5.0, 5.0, 2 * TTL_S]))
    def clock_jumps(self, actor: str, jump: float) -> None:
        self.world.skew[actor] += jump

    @precondition(lambda self: len(self.world.dead) < len(ACTORS))
    @rule(actor=st.sampled_from(ACTORS))
    def dies(self, actor: str) -> None:
        """SIGKILL: its flocks are gone with it (it holds none between rules), its lease stays."""
        self.world.dead.add(actor)

    @rule(actor=st.sampled_from(ACTORS))
    def restarts(self, actor: str) -> None:
        if actor in self.world.dead:
            self._start(actor)

    # ------------------------------------------------------------------------------ invariants

    @invariant()
    def actions_follow_the_generations(self) -> None:
        generations = [generation for generation, _ in self.acted]
        assert generations == sorted(generations), f"a taken-over holder acted: {self.acted}"

    @invariant()
    def one_generation_one_actor(self) -> None:
        actors: dict[int, set[str]] = {}
        for generation, actor in self.acted:
            actors.setdefault(generation, set()).add(actor)
        assert all(len(who) == 1 for who in actors.values()), self.acted


LeaseProtocol.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_the_lease_protocol = LeaseProtocol.TestCase
