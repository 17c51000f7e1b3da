"""The checkpoint benchmark's training job: a DDP MLP (gloo, every rank on the CPU) trained with AdamW,
run under torchrun with the training contract's variables, as a tunepod job is.

Its parameters (``TUNEPOD_PARAMS``): ``width`` and ``layers`` (the MLP: ``layers`` square linear
layers, so the state, weights and AdamW's two moments in float32, is ~``12 * layers * width**2``
bytes), ``batch``, and ``phase``:

- ``stall``: segments of ``saves`` saves every ``interval`` steps, one segment per method in
  ``methods`` (the order rotated each of ``rounds`` rounds), after one untimed first save per
  method; every step's time and every save call's time (the call, then a barrier: until every rank
  can train again) go to ``stall.json``. Then the ``ready`` marker, and training goes on until the
  job is killed.
- ``prepare``: one committed save per method in ``resume_methods``, the marker, training until killed.
- ``resume``: load the newest checkpoint of ``method``, take one step, write ``resumed.json``
  (rank 0: wall-clock times of the script's start, imports, rendezvous, model built, checkpoint
  loaded, first step done), train until killed.

Each method writes under its own folder of ``TUNEPOD_CHECKPOINT_DIR``. Methods:
``torch.save`` (rank 0, the path as a plain script writes it, the file of two saves back removed),
``torch.save+fsync`` (the same, fsynced), ``tunepod`` (``ctx.save_checkpoint(state, step)``),
``tunepod-sharded`` (``sharded=True``), ``tunepod-async`` (``async_save=True``),
``tunepod-async-process`` (``async_save="process"``), ``tunepod-memory`` and ``tunepod-memory-sharded``
(the memory tier, whole-state and ``sharded=True``: checkpoint tiers that send every save to node memory
and, after the first save, none to the shared folder; see ``Jobs.memory_environ``), ``copy`` (rank 0
copies the state's tensors into buffers kept from its first call and does nothing else: the floor of
any save that returns once the state is copied), and ``none`` (no save: the steps' own time). The
memory tier's folders are under the ``memory_dir`` parameter.
"""

import time

STARTED = time.time()

import json  # noqa: E402 - the start time is taken before anything is imported
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tunepod import runtime  # noqa: E402

IMPORTED = time.time()

PLAIN = ("torch.save", "torch.save+fsync")
ASYNC = {"tunepod-async": True, "tunepod-async-process": "process"}
MEMORY = ("tunepod-memory", "tunepod-memory-sharded")
SHARDED = ("tunepod-sharded", *ASYNC)
#: The memory tier's shared_every_steps: after the first save (which goes to both tiers), memory only.
NEVER = 10**9
READY = "ready"
LIMIT_S = 900.0  # a job the benchmark lost track of stops on its own


def main() -> None:
    ctx = runtime.init({"width": 256, "layers": 4, "batch": 32, "phase": "stall"})
    params = ctx.params
    dist.init_process_group("gloo")
    rendezvous = time.time()
    torch.manual_seed(0)
    model, optimizer = build(int(params["width"]), int(params["layers"]))
    built = time.time()
    jobs = Jobs(ctx, int(params["batch"]), int(params["width"]), model, optimizer)
    root = ctx.checkpoint_dir
    if params["phase"] == "resume":
        method = str(params["method"])
        step = jobs.load(method, root / method)
        loaded = time.time()
        jobs.step()
        first_step = time.time()
        times = {"started": STARTED, "imported": IMPORTED, "rendezvous": rendezvous, "built": built}
        times |= {"loaded": loaded, "first_step": first_step}
        jobs.write(root / "resumed.json", {"method": method, "step": step, "times": times})
    elif params["phase"] == "prepare":
        for method in params["resume_methods"]:
            jobs.save(method, root / method, 1)
            jobs.save(method, root / method, 2)  # a second one: a resume looks past the newest
        jobs.wait_all()
        jobs.write(root / f"{READY}.json", {"step": 2})
    else:
        stall(jobs, params, root)
        jobs.write(root / f"{READY}.json", {})
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:  # until the benchmark kills the job
        jobs.step()
    sys.exit(3)


def build(width: int, layers: int) -> tuple[Any, Any]:
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width, bias=False), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*blocks))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


class Jobs:
    """The training step, and saving and loading by each method."""

    def __init__(self, ctx: Any, batch: int, width: int, model: Any, optimizer: Any) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self.batch, self.width = batch, width
        self.model, self.optimizer = model, optimizer
        self.contexts: dict[str, Any] = {}
        self.written: dict[str, list[Path]] = {}
        self.copies: list[torch.Tensor] = []

    def step(self) -> None:
        inputs = torch.randn(self.batch, self.width)
        self.model(inputs).square().mean().backward()  # DDP: the gradients' all-reduce
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def context(self, method: str, folder: Path) -> Any:
        """One tunepod context per method, each with its own checkpoint folder."""
        if method not in self.contexts:
            environ = {**os.environ, runtime.CHECKPOINT_DIR_ENV: str(folder)}
            if method in MEMORY:
                environ |= self.memory_environ()
            self.contexts[method] = runtime.init(environ=environ)
        return self.contexts[method]

    def memory_environ(self) -> dict[str, str]:
        """Checkpoint tiers that send every save to memory (the first to the shared folder too), with
        each rank standing in for a node of its own (its own memory folder, node id and local rank
        0), so that every memory save is also copied to the other rank's "node" over HTTP, as in a
        job of two nodes of one process each: the background work a memory save really causes."""
        memory_dir = Path(self.ctx.params["memory_dir"]) / f"node-{self.rank}"
        tiers = runtime.CheckpointTiers(1, NEVER, memory_replicas=1, memory_dir=str(memory_dir))
        return {
            runtime.CHECKPOINT_TIERS_ENV: tiers.to_json(),
            "GROUP_RANK": str(self.rank),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }

    def save(self, method: str, folder: Path, step: int) -> None:
        if method == "none":
            return
        if method == "copy":
            if self.rank == 0:
                self.copy_state()
            return
        if method in PLAIN:
            if self.rank == 0:
                self.save_plain(folder, step, fsync=method == "torch.save+fsync")
            return
        ctx = self.context(method, folder)
        if method in ("tunepod", "tunepod-memory"):
            ctx.save_checkpoint(self.plain_state(step), step)
        elif method == "tunepod-memory-sharded":
            ctx.save_checkpoint(self.dcp_state(step), step, sharded=True)
        else:
            ctx.save_checkpoint(self.dcp_state(step), step, sharded=True, async_save=ASYNC.get(method, False))

    def save_plain(self, folder: Path, step: int, fsync: bool) -> None:
        """What a plain training script does: ``torch.save`` to ``step-N.pt``, keep the last two."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step-{step:06d}.pt"
        with open(path, "wb") as handle:
            torch.save(self.plain_state(step), handle)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        written = self.written.setdefault(str(folder), [])
        written.append(path)
        if len(written) > 2:
            written.pop(0).unlink(missing_ok=True)

    def copy_state(self) -> int:
        """The floor: the state's tensors copied into buffers allocated at the first call, in one
        ``torch._foreach_copy_`` on this thread (no structure rebuilt, nothing else); its bytes."""
        sources = [*self.model.state_dict().values()]
        moments = [v for s in self.optimizer.state.values() for v in s.values()]
        sources += [v for v in moments if isinstance(v, torch.Tensor)]
        if not self.copies:
            self.copies = [torch.empty_like(t) for t in sources]
        torch._foreach_copy_(self.copies, sources)
        return sum(t.numel() * t.element_size() for t in sources)

    def plain_state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}

    def dcp_state(self, step: int) -> dict[str, Any]:
        """The same tensors, keyed as DCP loads them back (the optimizer's by parameter name)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, moments = get_state_dict(self.model, self.optimizer)
        return {"model": weights, "optimizer": moments, "step": step}

    def wait_all(self) -> None:
        for ctx in self.contexts.values():
            ctx.wait_for_checkpoint()

    def load(self, method: str, folder: Path) -> int:
        """Resume: load the newest checkpoint of ``method`` into the model and optimizer; its step."""
        if method in PLAIN:
            newest = sorted(folder.glob("step-*.pt"))[-1]
            state = torch.load(newest, map_location="cpu", weights_only=True)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            return int(state["step"])
        ctx = self.context(method, folder)
        if method == "tunepod":
            loaded = ctx.load_latest_checkpoint()
            self.model.load_state_dict(loaded.state["model"])
            self.optimizer.load_state_dict(loaded.state["optimizer"])
            return int(loaded.step)
        from torch.distributed.checkpoint.state_dict import set_state_dict

        into = self.dcp_state(0)  # the optimizer's moments allocated, to be filled in place
        loaded = ctx.load_latest_checkpoint(into=into)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=into["model"], optim_state_dict=into["optimizer"]
        )
        return int(loaded.step)

    def write(self, path: Path, content: dict[str, Any]) -> None:
        """Rank 0 writes (atomically: the benchmark polls for it); every rank agrees it is written."""
        dist.barrier()
        if self.rank == 0:
            temp = path.with_name(f".{path.name}.tmp")
            temp.write_text(json.dumps(content))
            temp.replace(path)


def stall(jobs: Jobs, params: dict[str, Any], root: Path) -> None:
    """Time every step and every save call of each method's segments; rank 0 writes stall.json."""
    methods = list(params["methods"])
    interval, saves, rounds = int(params["interval"]), int(params["saves"]), int(params["rounds"])
    for _ in range(2):
        jobs.step()  # warm-up: DDP's buckets, the allocator
    step = 0
    first: dict[str, float] = {}
    for method in methods:  # one untimed-in-the-medians first save each: process groups, writer processes
        step += 1
        first[method] = timed_save(jobs, method, root / method, step)
    jobs.wait_all()
    steps: dict[str, list[float]] = {m: [] for m in methods}
    calls: dict[str, list[float]] = {m: [] for m in methods}
    drains: dict[str, list[float]] = {m: [] for m in methods}
    for round_ in range(rounds):
        shift = round_ % len(methods)
        for method in methods[shift:] + methods[:shift]:
            for _ in range(saves):
                for _ in range(interval):
                    started = time.perf_counter()
                    jobs.step()
                    steps[method].append(time.perf_counter() - started)
                step += 1
                calls[method].append(timed_save(jobs, method, root / method, step))
            started = time.perf_counter()
            jobs.wait_all()  # the segment's last async save, outside the stalls (see the README)
            dist.barrier()
            drains[method].append(time.perf_counter() - started)
    sizes = {m: folder_bytes(root / m) for m in methods}
    sizes["copy"] = jobs.copy_state() if "copy" in methods else 0
    if jobs.rank == 0:
        result = {"steps": steps, "calls": calls, "first": first, "drains": drains, "bytes": sizes}
        (root / "stall.json").write_text(json.dumps(result))


def timed_save(jobs: Jobs, method: str, folder: Path, step: int) -> float:
    """Seconds from the save call until every rank is past it (the barrier): the training stall."""
    dist.barrier()
    started = time.perf_counter()
    jobs.save(method, folder, step)
    dist.barrier()
    return time.perf_counter() - started


def folder_bytes(folder: Path) -> int:
    """Bytes of the newest checkpoint in ``folder`` (a step file, or a step folder's files)."""
    newest = sorted(folder.glob("step-*"))
    if not newest:
        return 0
    if newest[-1].is_file():
        return newest[-1].stat().st_size
    return sum(f.stat().st_size for f in newest[-1].iterdir() if f.name != "metadata.json")


if __name__ == "__main__":
    main()
