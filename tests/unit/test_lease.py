"""Leases: one driver per job dir, taken over only from a holder that is gone or stopped renewing."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from holder import hold

from tunepod.launch.lease import LeaseRecord, Leases, read_lease
from tunepod.launch.paths import JobPaths
from tunepod.runtime.files import write_bytes_atomic


def test_a_held_lease_is_refused_to_another_driver_until_released(tmp_path: Path) -> None:
    first, second = Leases(private_job_dirs=True), Leases(private_job_dirs=True)
    lease = first.acquire(tmp_path / "job")
    assert lease is not None
    assert second.acquire(tmp_path / "job") is None
    holder = second.holder(tmp_path / "job")
    assert holder is not None and holder.owner == first.owner
    assert first.acquire(tmp_path / "job") is None  # nor to its holder's other callers: it drives it
    lease.release()
    taken = second.acquire(tmp_path / "job")
    assert taken is not None
    taken.release()


def test_the_lease_of_a_sigkilled_driver_on_this_host_is_free_at_once(tmp_path: Path) -> None:
    holder = hold(
        f"""
        from tunepod.launch.lease import Leases
        assert Leases(private_job_dirs=True, ttl_s=3600).acquire(Path({str(tmp_path / "job")!r}))
        """
    )
    assert Leases(private_job_dirs=True).acquire(tmp_path / "job") is None
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lease = Leases(private_job_dirs=True).acquire(tmp_path / "job")
    assert lease is not None
    lease.release()


def test_a_remote_holder_keeps_the_lease_until_it_stops_renewing_for_its_ttl(tmp_path: Path) -> None:
    paths = JobPaths(tmp_path / "job")
    paths.job_dir.mkdir()

    def remote(renewed_s_ago: float) -> None:
        record = LeaseRecord(
            owner="elsewhere:1:x", host="another-host", pid=1, pid_start_ticks=1,
            renewed_at=time.time() - renewed_s_ago, ttl_s=60,
        )  # fmt: skip
        write_bytes_atomic(paths.lease, record.model_dump_json().encode())

    remote(renewed_s_ago=5)
    assert Leases(private_job_dirs=True).acquire(paths.job_dir) is None
    remote(renewed_s_ago=120)
    taker = Leases(private_job_dirs=True)
    lease = taker.acquire(paths.job_dir)
    assert lease is not None
    taken = read_lease(paths)
    assert taken is not None and taken.owner == taker.owner
    lease.release()


def test_a_holder_that_finds_its_lease_taken_knows_it_lost_it(tmp_path: Path) -> None:
    slow, taker = Leases(private_job_dirs=True), Leases(private_job_dirs=True)
    lease = slow.acquire(tmp_path / "job")
    assert lease is not None
    # The slow holder stalled past its TTL and the taker took the lease over.
    stolen = LeaseRecord(
        owner=taker.owner, host="h", pid=2, pid_start_ticks=2, renewed_at=time.time(), ttl_s=60
    )
    write_bytes_atomic(JobPaths(tmp_path / "job").lease, stolen.model_dump_json().encode())
    slow.renew(lease)
    assert lease.lost
    lease.release()  # a lost lease is not released on the new holder's behalf
    kept = read_lease(JobPaths(tmp_path / "job"))
    assert kept is not None and kept.owner == taker.owner


def test_a_second_thread_of_the_holder_waits_outside_the_fence(tmp_path: Path) -> None:
    """Found by the simulation: a promotion entered a trial's fence on the same lease while the
    trial's own driver was still inside it, recording the pause. The fence's re-entry is one thread's,
    so the second thread waits until the first has left."""
    lease = Leases(private_job_dirs=True).acquire(tmp_path / "job")
    assert lease is not None
    inside, leave = threading.Event(), threading.Event()
    order: list[str] = []

    def driver() -> None:
        with lease.fenced(), lease.fenced():  # re-entrant for the thread inside
            order.append("driver in")
            inside.set()
            leave.wait(10)
            order.append("driver out")

    def promotion() -> None:
        with lease.fenced():
            order.append("promotion in")

    first = threading.Thread(target=driver)
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=promotion)
    second.start()
    second.join(0.5)
    assert second.is_alive() and order == ["driver in"], "the second thread entered beside the first"
    leave.set()
    first.join(10)
    second.join(10)
    assert order == ["driver in", "driver out", "promotion in"]
    lease.release()
