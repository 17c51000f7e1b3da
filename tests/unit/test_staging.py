"""The stager behind async sharded and memory-tier saves (``tunepod.runtime.staging``): its copy is
the state at the call, whatever the training loop does after it; its buffers are reused across saves;
views, shared storages, a state_dict's ``_metadata`` and nested plain values survive a ``torch.save``
round trip as they would without it; a copy split over threads is byte for byte the same; a state it
does not know is left to DCP's stager."""

from __future__ import annotations

import collections
import io
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tunepod.runtime import staging  # noqa: E402
from tunepod.runtime.staging import ReusableStager, copy_threads  # noqa: E402


def trained_state() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}


def round_trip(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_copy_is_the_state_at_the_call_whatever_changes_after() -> None:
    state = trained_state()
    staged = ReusableStager().stage(state)
    expected = round_trip(state)
    for tensor in state["model"].values():
        tensor.add_(1)
    state["optimizer"]["param_groups"][0]["lr"] = 99.0
    state["model"]._metadata[""]["version"] = 99

    again = round_trip(staged)
    assert again["step"] == 3
    assert again["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for key, tensor in expected["model"].items():
        assert torch.equal(again["model"][key], tensor), key
    for index, moments in expected["optimizer"]["state"].items():
        for name, tensor in moments.items():
            assert torch.equal(again["optimizer"]["state"][index][name], tensor), (index, name)
    assert type(again["model"]) is collections.OrderedDict
    assert again["model"]._metadata == expected["model"]._metadata


def test_buffers_are_allocated_once_and_refilled() -> None:
    weights = {"w": torch.randn(1000), "b": torch.randn(10)}
    stager = ReusableStager()
    first = stager.stage(weights)
    pointers = {key: tensor.data_ptr() for key, tensor in first.items()}
    weights["w"].mul_(2)
    second = stager.stage(weights)
    assert {key: tensor.data_ptr() for key, tensor in second.items()} == pointers
    assert torch.equal(second["w"], weights["w"])


def test_views_and_shared_storages_keep_their_layout() -> None:
    base = torch.arange(20.0)
    state = {"base": base, "slice": base[3:9], "transposed": base.view(4, 5).t(), "tied": base}
    staged = ReusableStager().stage(state)
    for key, tensor in state.items():
        assert torch.equal(staged[key], tensor), key
        assert staged[key].stride() == tensor.stride()
    storage = staged["base"].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in staged.values())
    again = round_trip(staged)  # one storage in the file, as torch.save of the state itself writes
    assert again["slice"].untyped_storage().data_ptr() == again["base"].untyped_storage().data_ptr()


def test_a_copy_split_over_threads_is_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "MIN_BYTES_PER_THREAD", 1000)  # small states split too
    state = {f"t{i}": torch.randn(n) for i, n in enumerate((3000, 17, 5000, 1, 2500))}
    stager = ReusableStager(num_threads=3)
    for _ in range(2):  # the second refills the first's buffers
        staged = stager.stage(state)
        assert all(torch.equal(staged[key], tensor) for key, tensor in state.items())
        for tensor in state.values():
            tensor.add_(1)
    stager.close()


def test_what_it_does_not_know_goes_to_dcps_stager() -> None:
    class Holder:
        def __init__(self, tensor: Any) -> None:
            self.tensor = tensor

    state = {"holder": Holder(torch.ones(3)), "w": torch.zeros(2)}
    staged = ReusableStager().stage(state)
    state["holder"].tensor.add_(1)
    assert torch.equal(staged["holder"].tensor, torch.ones(3))
    assert staged["holder"] is not state["holder"]


def test_copy_threads_share_the_cpus_among_the_nodes_processes() -> None:
    assert copy_threads({"LOCAL_WORLD_SIZE": "100000"}) == 1
    assert 1 <= copy_threads({}) <= staging.MAX_COPY_THREADS
    assert copy_threads({"LOCAL_WORLD_SIZE": "junk"}) == copy_threads({})
