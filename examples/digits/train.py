"""Train a small MLP on the digits dataset, under torchrun (DDP over gloo) or as one process.

Run it (from the repository root, with tunepod importable: `pip install -e .` or `PYTHONPATH=.`):

    python examples/digits/train.py                                      # one process, on the CPU
    torchrun --standalone --nproc-per-node 2 examples/digits/train.py    # two processes, DDP over gloo
    TUNEPOD_PARAMS='{"lr": 0.05, "optimizer": "sgd", "epochs": 8}' python examples/digits/train.py

tunepod runs it as a trial: the parameters, the data and checkpoint folders and the result file come
from the environment (see tunepod.runtime). Outside a job it works under .tunepod/local/ and writes
the digits there first; run it again and it resumes from its last checkpoint.

Parameters: lr, hidden, optimizer (adam | sgd with momentum 0.9), epochs, batch_size, seed, and
epoch_sleep_s, which only exists for tests that kill a run mid-way: it sleeps after each epoch's
checkpoint. Any other parameter is an error.
Epochs are numbered from 0; checkpoint step N is the state after epoch N.
"""

import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tunepod import runtime

DEFAULTS = {
    "lr": 0.01,
    "hidden": 64,
    "optimizer": "adam",
    "epochs": 5,
    "batch_size": 64,
    "seed": 0,
    "epoch_sleep_s": 0.0,
}

# ---------------------------------------------------------------------------------------------- setup
ctx = runtime.init(DEFAULTS)
unknown = sorted(set(ctx.params) - set(DEFAULTS))
if unknown:
    raise SystemExit(f"unknown params {unknown}; valid params: {sorted(DEFAULTS)}")
params = ctx.params
if params["optimizer"] not in ("adam", "sgd"):
    raise SystemExit(f"optimizer must be adam or sgd, got {params['optimizer']!r}")

# Two processes share two cores here: more threads per process would only fight over them. On the CPU
# with one thread, every op here is deterministic already: torch.use_deterministic_algorithms(True)
# would add nothing but ~2 s to each trial's start (it imports torch's compiler configuration).
torch.set_num_threads(1)
torch.manual_seed(params["seed"])
distributed = ctx.world_size > 1
if distributed:
    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment

if not (ctx.data_dir / "train.npz").exists():
    if ctx.source != "local":
        raise SystemExit(f"no train.npz in {ctx.data_dir}; stage builtin://digits there first")
    from tunepod.staging.builtin import write_digits

    write_digits(ctx.data_dir)  # deterministic and atomic per file, so every rank may do it


def load_split(name):
    arrays = np.load(ctx.data_dir / f"{name}.npz")
    return TensorDataset(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]))


train_set, val_set = load_split("train"), load_split("val")
# The same sampler with or without torchrun: one replica sees everything, in the same shuffled order.
sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank, seed=params["seed"])
train_loader = DataLoader(train_set, batch_size=params["batch_size"], sampler=sampler)

# ---------------------------------------------------------------------------------------------- model
model_config = {"in_features": 64, "hidden": params["hidden"], "num_classes": 10}


def build_model(in_features, hidden, num_classes):
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


model = build_model(**model_config)
if params["optimizer"] == "adam":
    optimizer = torch.optim.Adam(model.parameters(), lr=params["lr"])
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=0.9)

start_epoch = 0
checkpoint = ctx.load_latest_checkpoint()
if checkpoint is not None:
    model.load_state_dict(checkpoint.state["model"])
    optimizer.load_state_dict(checkpoint.state["optimizer"])
    # The saved state carries the lr it was saved with: under population-based training that is the
    # donor's, and this trial's own (explored) lr applies from here on.
    for group in optimizer.param_groups:
        group["lr"] = params["lr"]
    start_epoch = checkpoint.state["epoch"] + 1
    if ctx.is_main:
        print(f"resuming from {checkpoint.path} at epoch {start_epoch}", flush=True)
trained = DistributedDataParallel(model) if distributed else model


def accuracy(dataset):
    x, y = dataset.tensors
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def mean_over_ranks(value):
    if not distributed:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / ctx.world_size


# ---------------------------------------------------------------------------------------------- train
for epoch in range(start_epoch, params["epochs"]):
    sampler.set_epoch(epoch)
    trained.train()
    losses = []
    for batch, (x, y) in enumerate(train_loader):
        loss = nn.functional.cross_entropy(trained(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        # Every rank: times the step and counts its samples (per-rank step time and samples/s).
        ctx.step_done(epoch * len(train_loader) + batch, samples=len(y))
    train_loss = mean_over_ranks(sum(losses) / len(losses))
    model.eval()
    val_accuracy = accuracy(val_set)  # every rank holds the same weights, so the same value
    ctx.report(epoch, val_accuracy=val_accuracy, train_loss=train_loss)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "model_config": model_config,
        "params": params,
    }
    ctx.save_checkpoint(state, epoch)
    if ctx.is_main:
        print(f"epoch {epoch}: train_loss {train_loss:.4f} val_accuracy {val_accuracy:.4f}", flush=True)
    if ctx.should_stop():  # SIGTERM (preempted, requeued, pruned): this epoch is saved, resume from it
        raise SystemExit(0)
    time.sleep(params["epoch_sleep_s"])

model.eval()
ctx.finish(val_accuracy=accuracy(val_set))
if distributed:
    # Wait for rank 0's last checkpoint and result before anyone tears gloo down: a rank that leaves
    # while the others still hold connections can abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
