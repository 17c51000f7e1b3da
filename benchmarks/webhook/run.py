"""One run: the servers up, the warm-up, the same-id race, then each concurrency level's rounds.

Sides, in each round's rotating order:

- baseline: the bare endpoint (``baseline``);
- tunepod: the receiver, every delivery the same payload (so the same overrides);
- tunepod-new: the receiver, every delivery a ``num_trials`` of its own (overrides never seen before);
- sink alone: the receiver's publish call alone (``PrefectEventSink.publish`` in a worker thread),
  made by the load generator: what the publisher does for each delivery after its 202.

Prefect stores events after answering, in batches; after each batch of a side that publishes, the
next batch waits until Prefect has stored them all, so that no side is measured while Prefect's
server is still busy with another side's events.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.webhook import load, servers, sink
from benchmarks.webhook.load import Load, Race
from benchmarks.webhook.servers import LOAD_HOOK, RACE_HOOK, Server
from tunepod.webhook.signatures import new_standard_secret

ACCEPTED = 202
DUPLICATE = 200


@dataclass(frozen=True)
class Side:
    name: str
    kind: str  # baseline | tunepod | sink
    what: str
    payloads: load.Payloads = load.body

    @property
    def expected_status(self) -> int:
        return load.PUBLISHED if self.kind == "sink" else ACCEPTED

    @property
    def hook(self) -> str | None:
        """The hook whose events this side makes Prefect store (None: it makes none)."""
        return {"tunepod": LOAD_HOOK, "sink": load.SINK_HOOK}.get(self.kind)


SIDES = (
    Side("baseline", "baseline", "bare FastAPI POST -> 202"),
    Side("tunepod", "tunepod", "tunepod webhook serve, same overrides"),
    Side("tunepod-new", "tunepod", "tunepod webhook serve, new overrides", load.distinct_body),
    Side("sink alone", "sink", "PrefectEventSink.publish, no receiver"),
)
BASELINE = SIDES[0].name


@dataclass
class Measured:
    """Everything one run measured; ``levels`` maps a concurrency to each side's load."""

    levels: dict[int, dict[str, Load]] = field(default_factory=dict)
    warmup: dict[str, Load] = field(default_factory=dict)
    race: Race | None = None
    race_events: int = 0
    catch_up_s: list[float] = field(default_factory=list)

    def failures(self) -> list[str]:
        found = []
        phases = [("warm-up", self.warmup)] + [(f"{c} in flight", s) for c, s in self.levels.items()]
        for phase, loads in phases:
            for side in SIDES:
                measured = loads.get(side.name, Load())
                wrong = {s: n for s, n in measured.statuses.items() if s != side.expected_status}
                if wrong or measured.errors:
                    errors = measured.errors[:3]
                    found.append(f"{side.name}, {phase}: unexpected answers {wrong}, errors {errors}")
        if self.race is not None and not race_correct(self.race, self.race_events):
            found.append("tunepod: the same-id race did not give exactly one accepted delivery and one event")
        return found


class Bench:
    """The running servers, and how many events each hook has had Prefect store so far."""

    def __init__(self, args: argparse.Namespace, api_url: str, prefect: httpx.Client, baseline: Server,
                 receiver: Server) -> None:  # fmt: skip
        self.args, self.api_url, self.prefect = args, api_url, prefect
        self.servers = {"baseline": baseline, "tunepod": receiver}
        self.secret = receiver.secret
        # A reused Prefect server may hold events of earlier runs already.
        self.published = {hook: sink.stored_events(prefect, api_url, hook, limit=1)[0]
                          for hook in (LOAD_HOOK, load.SINK_HOOK)}  # fmt: skip

    def batch(self, side: Side, count: int, concurrency: int) -> Load:
        """``count`` requests of ``side``, ``concurrency`` at a time; its server's CPU time meanwhile."""
        if side.kind == "sink":
            measured = asyncio.run(load.publish_events(self.api_url, count, concurrency))
            measured.server_cpu_s = math.nan  # Prefect's process is not the benchmark's
        else:
            server = self.servers[side.kind]
            cpu_before = servers.cpu_seconds(server.process)
            url = server.hook_url(LOAD_HOOK)
            measured = asyncio.run(load.deliver(url, self.secret, count, concurrency, side.payloads))
            measured.server_cpu_s = servers.cpu_seconds(server.process) - cpu_before
        if side.hook is not None:
            self.published[side.hook] += measured.statuses[side.expected_status]
        return measured

    def wait_for_prefect(self, side: Side) -> float:
        """Seconds until Prefect has stored every event ``side`` made it publish (0 with ``--no-settle``)."""
        if side.hook is None or not self.args.settle:
            return 0.0
        expected = self.published[side.hook]
        return sink.wait_until_stored(self.prefect, self.api_url, side.hook, expected, self.args.timeout_s)


def run(args: argparse.Namespace, folder: Path) -> Measured:
    measured = Measured()
    with (
        sink.prefect_api(args.prefect_api) as api_url,
        httpx.Client() as prefect,
        servers.both(folder, new_standard_secret(), api_url, args.timeout_s) as (baseline, receiver),
    ):
        print(f"Prefect API {api_url}; baseline {baseline.url}; tunepod {receiver.url}", flush=True)
        bench = Bench(args, api_url, prefect, baseline, receiver)
        for side in SIDES:
            measured.warmup[side.name] = bench.batch(side, args.warmup, max(args.concurrency))
            bench.wait_for_prefect(side)
        if args.race_copies:
            measured.race, measured.race_events = run_race(bench)
        for concurrency in args.concurrency:
            measured.levels[concurrency] = run_level(bench, concurrency, measured.catch_up_s)
    return measured


def run_level(bench: Bench, concurrency: int, catch_up_s: list[float]) -> dict[str, Load]:
    """Every side's ``--requests`` at ``concurrency``, in ``--rounds`` rounds of rotating order."""
    loads = {side.name: Load() for side in SIDES}
    rounds = split(bench.args.requests, bench.args.rounds)
    for round_index, count in enumerate(rounds):
        for side in rotated(SIDES, round_index):
            loads[side.name].add(bench.batch(side, count, concurrency))
            catch_up_s.append(round(bench.wait_for_prefect(side), 2))
    return loads


def rotated(sides: Sequence[Side], shift: int) -> list[Side]:
    """Round ``shift``'s order: each side goes first in turn, none always measured after the same one."""
    shift %= len(sides)
    return [*sides[shift:], *sides[:shift]]


def split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal positive counts (fewer parts when ``total`` is smaller)."""
    parts = min(parts, total)
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def run_race(bench: Bench) -> tuple[Race, int]:
    """The race, and how many events Prefect stored for its delivery id.

    A second delivery (the sentinel) follows the race; Prefect stores events in the order they
    arrive, so once the sentinel's event is stored, every event the race published is stored too.
    """
    url, secret = bench.servers["tunepod"].hook_url(RACE_HOOK), bench.secret
    delivery_id = f"race-{uuid.uuid4().hex}"
    raced = asyncio.run(load.race(url, secret, bench.args.race_copies, delivery_id))
    sentinel = httpx.post(url, content=load.body(), headers=load.signed(secret, load.body()), timeout=30)
    sentinel.raise_for_status()
    event_id = sentinel.json()["event_id"]
    sink.wait_for_event(bench.prefect, bench.api_url, RACE_HOOK, event_id, bench.args.timeout_s)
    _, events = sink.stored_events(bench.prefect, bench.api_url, RACE_HOOK)
    return raced, sum(1 for event in events if event["payload"]["delivery_id"] == delivery_id)


def race_correct(race: Race, events: int) -> bool:
    copies = sum(race.statuses.values())
    one_accepted = race.statuses[ACCEPTED] == 1 and race.statuses[DUPLICATE] == copies - 1
    return one_accepted and not race.errors and len(race.event_ids) == 1 and events == 1
