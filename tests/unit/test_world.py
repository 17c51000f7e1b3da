"""The installed world belongs to the OS thread that installed it."""

from __future__ import annotations

import threading

from tunepod import world


class _StoppedClock(world.RealWorld):
    def time(self) -> float:
        return 42.0


def test_a_world_installed_on_one_thread_is_not_seen_by_another() -> None:
    # A simulated seed installs its world on the test's thread; a thread some other test left
    # running must keep the real clocks, or its reads would change the seed's run.
    seen_elsewhere: list[float] = []
    with world.installed(_StoppedClock()):
        other = threading.Thread(target=lambda: seen_elsewhere.append(world.time()))
        other.start()
        other.join()
        assert world.time() == 42.0
    assert seen_elsewhere and seen_elsewhere[0] > 1e9
    assert world.time() > 1e9
