"""The memory tier's rules without processes: the layout of a node's folder, the manifest that makes a
writer's files count, the choice of the step a restore takes, pruning, the refusal of paths that
leave the job's folder, and the peer server's requests (a real server on loopback). The tier with
torchrun: tests/integration/test_memory_tier.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tunepod.runtime import memory_store as store
from tunepod.runtime.memory_store import FileEntry, Manifest, RestorePlan, StepListing, choose_restore
from tunepod.runtime.peer_http import PeerError, PeerServer, delete_manifest, fetch_file, push_file

NONCE, OLD = "new-attempt", "old-attempt"


def entry(data: bytes) -> FileEntry:
    return FileEntry(hashlib.sha256(data).hexdigest(), len(data))


def write_step(job: Path, step: int, writer: int, writers: tuple[int, ...], nonce: str = NONCE) -> Manifest:
    """``writer``'s files of ``step`` written the way a save writes them: files, then the manifest."""
    folder = store.step_folder(job, step)
    name = f"__{writer}_0.distcp"
    store.begin_writing(folder, writer, [name])
    data = f"{step}-{writer}-{nonce}".encode()
    store.write_file(folder / name, data)
    manifest = Manifest(step, writer, writers, "dcp", nonce, float(step), {name: entry(data)})
    store.write_manifest(folder, manifest)
    return manifest


def listing(manifests: list[Manifest], sizes: dict[str, int] | None = None) -> StepListing:
    """A node's step holding ``manifests`` and their files (``sizes`` overrides or removes some)."""
    found = {name: e.size for m in manifests for name, e in m.files.items()}
    found.update(sizes or {})
    return StepListing({m.writer: m for m in manifests}, {n: s for n, s in found.items() if s >= 0})


def manifest(step: int, writer: int, writers: tuple[int, ...] = (0, 1), nonce: str = NONCE) -> Manifest:
    data = f"{step}-{writer}".encode()
    return Manifest(
        step,
        writer,
        writers,
        "dcp",
        nonce,
        1.0 if nonce == OLD else 2.0,
        {f"__{writer}_0.distcp": entry(data)},
    )


# ---------------------------------------------------------------------------------------------- layout


def test_a_job_has_one_folder_per_checkpoint_folder_stable_across_restarts(tmp_path: Path) -> None:
    one = store.job_folder("/dev/shm", tmp_path / "trial-1" / "checkpoints")
    assert one == store.job_folder("/dev/shm", tmp_path / "trial-1" / ".." / "trial-1" / "checkpoints")
    assert one != store.job_folder("/dev/shm", tmp_path / "trial-2" / "checkpoints")
    assert one.parent == Path("/dev/shm/tunepod") and len(one.name) == 16


def test_a_node_folder_lists_steps_with_their_manifests_and_file_sizes(tmp_path: Path) -> None:
    written = write_step(tmp_path, 8, writer=1, writers=(0, 1))
    (store.step_folder(tmp_path, 8) / ".~__0_0.distcp.abcd").write_bytes(b"half written")
    found = store.list_job_folder(tmp_path)
    assert list(found) == [8]
    assert found[8].manifests == {1: written}
    assert found[8].sizes == {
        "__1_0.distcp": written.files["__1_0.distcp"].size,
        "manifest-rank1.json": found[8].sizes["manifest-rank1.json"],
    }


def test_a_writer_removes_its_manifest_before_its_files_so_a_kill_mid_write_leaves_no_manifest(
    tmp_path: Path,
) -> None:
    write_step(tmp_path, 8, writer=0, writers=(0,), nonce=OLD)
    folder = store.step_folder(tmp_path, 8)
    # A new attempt starts writing step 8 again and is killed before its manifest.
    store.begin_writing(folder, 0, ["__0_0.distcp"])
    with pytest.raises(RuntimeError), store.writing(folder / "__0_0.distcp") as handle:
        handle.write(b"half")
        raise RuntimeError("killed")
    assert store.list_job_folder(tmp_path)[8].manifests == {}
    assert [p.name for p in folder.iterdir()] == []  # the hidden file went with the failure
    assert choose_restore({0: store.list_job_folder(tmp_path)}, None) is None


@pytest.mark.parametrize(
    "path",
    [
        "/../secret",
        "/step-000001/../../x",
        "/step-000001/a/b",
        "/etc/passwd",
        "/step-1x/state.pt",
        "/step-000001/.~tmp",
        "/step-000001/..",
        "/step-000001/",
    ],
)
def test_paths_outside_the_step_folders_are_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(store.UnsafePathError):
        store.request_path(tmp_path, path)


def test_step_files_and_dcp_metadata_are_allowed(tmp_path: Path) -> None:
    assert store.request_path(tmp_path, "/step-000001/.metadata") == tmp_path / "step-000001/.metadata"
    assert store.request_path(tmp_path, "/step-000001/manifest-rank3.json").name == "manifest-rank3.json"


# ---------------------------------------------------------------------------------------------- choice


def test_the_newest_step_complete_across_nodes_is_chosen_with_its_holders() -> None:
    nodes = {
        0: {8: listing([manifest(8, 0), manifest(8, 1)]), 10: listing([manifest(10, 0)])},
        1: {8: listing([manifest(8, 1)]), 10: listing([manifest(10, 1)], {"__1_0.distcp": 1})},
    }
    plan = choose_restore(nodes, newest_shared=6)
    assert plan is not None and (plan.step, plan.tier, plan.newest_shared) == (8, "memory", 6)
    assert plan.holders == {0: (0,), 1: (0, 1)}
    assert plan.files_of(1) == ["__1_0.distcp"] and plan.nonce == NONCE


def test_a_step_missing_a_writer_or_a_file_anywhere_is_incomplete() -> None:
    nodes = {
        0: {
            10: listing([manifest(10, 0)]),
            12: listing([manifest(12, 0), manifest(12, 1)], {"__1_0.distcp": -1}),
        },
        1: {10: listing([])},
    }
    assert choose_restore(nodes, None) is None


def test_manifests_of_two_attempts_never_make_one_step() -> None:
    # Writer 0's step 10 from the old attempt, writer 1's from the new one: not one step.
    mixed = {0: {10: listing([manifest(10, 0, nonce=OLD)])}, 1: {10: listing([manifest(10, 1)])}}
    assert choose_restore(mixed, 4) == RestorePlan(step=4, tier="shared", newest_shared=4)
    # Both attempts complete somewhere: the later written one.
    both = {
        0: {10: listing([manifest(10, 0, nonce=OLD), manifest(10, 1, nonce=OLD)])},
        1: {10: listing([manifest(10, 0), manifest(10, 1)])},
    }
    plan = choose_restore(both, None)
    assert plan is not None and plan.nonce == NONCE and plan.holders == {0: (1,), 1: (1,)}


def test_a_newer_shared_step_wins_and_an_equal_one_loses_to_memory() -> None:
    nodes = {0: {8: listing([manifest(8, 0, writers=(0,))])}}
    assert choose_restore(nodes, 12) == RestorePlan(step=12, tier="shared", newest_shared=12)
    equal = choose_restore(nodes, 8)
    assert equal is not None and equal.tier == "memory"
    assert choose_restore({0: {}}, None) is None


# ---------------------------------------------------------------------------------------------- pruning


def test_pruning_keeps_the_two_newest_steps_of_this_attempt_and_everything_newer(tmp_path: Path) -> None:
    for step in (2, 4):
        write_step(tmp_path, step, 0, (0,), nonce=OLD)
    write_step(tmp_path, 6, 0, (0,))
    store.prune_job_folder(tmp_path, NONCE)
    assert sorted(store.list_job_folder(tmp_path)) == [2, 4, 6]  # one step of this attempt: nothing goes
    write_step(tmp_path, 8, 0, (0,))
    store.step_folder(tmp_path, 10).mkdir()  # a save in progress
    store.prune_job_folder(tmp_path, NONCE)
    assert sorted(store.list_job_folder(tmp_path)) == [6, 8, 10]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ---------------------------------------------------------------------------------------------- peers


def test_a_peer_takes_files_then_the_manifest_serves_them_and_refuses_strangers(tmp_path: Path) -> None:
    source, peer = tmp_path / "source", tmp_path / "peer"
    written = write_step(source, 8, 0, (0,))
    peer.mkdir()
    pushed: list[bool] = []
    server = PeerServer(peer, "127.0.0.1", "token", on_manifest=lambda: pushed.append(True))
    try:
        folder = store.step_folder(source, 8)
        for name in [*written.files, store.manifest_name(0)]:
            push_file(server.address, "token", "step-000008", folder / name)
        assert pushed == [True]
        assert store.list_job_folder(peer)[8].manifests == {0: written}
        into = tmp_path / "fetched" / "__0_0.distcp"
        into.parent.mkdir()
        expected = written.files["__0_0.distcp"]
        fetch_file(server.address, "token", "step-000008", into, expected.sha256, expected.size)
        assert into.read_bytes() == (folder / "__0_0.distcp").read_bytes()
        with pytest.raises(PeerError, match="does not match"):
            fetch_file(server.address, "token", "step-000008", into, "0" * 64, expected.size)
        with pytest.raises(PeerError, match="403"):
            fetch_file(server.address, "wrong", "step-000008", into, expected.sha256, expected.size)
        with pytest.raises(PeerError, match="400"):
            push_file(server.address, "token", "..", folder / "__0_0.distcp")
        delete_manifest(server.address, "token", "step-000008", 0)
        assert store.list_job_folder(peer)[8].manifests == {}
        assert not os.path.exists(tmp_path / "__0_0.distcp")
    finally:
        server.close()
