"""Train a tiny byte-level GPT on the stdlib sources, under torchrun (DDP over gloo) or as one process.

Run it (from the repository root, with tunepod importable: `pip install -e .` or `PYTHONPATH=.`):

    python examples/tiny_llm/train_llm.py                                      # one process, on the CPU
    torchrun --standalone --nproc-per-node 2 examples/tiny_llm/train_llm.py    # two processes, DDP over gloo
    TUNEPOD_PARAMS='{"lr": 0.003, "n_layer": 3, "steps": 600}' python examples/tiny_llm/train_llm.py

tunepod runs it as a trial: the parameters, the data and checkpoint folders and the result file come
from the environment (see tunepod.runtime). Outside a job it works under .tunepod/local/ and writes
the corpus there first (builtin://python-stdlib); run it again and it resumes from its last checkpoint.

Parameters: lr (peak), lr_schedule (cosine: linear warmup for warmup_steps, then down to lr/10 at
`steps` | constant), weight_decay, n_layer, n_head, d_model, dropout, context (tokens per window),
batch_size (windows per process per step), steps (optimizer steps in all), eval_interval, seed.
Any other parameter is an error.
Every eval_interval steps and at the end, it reports val_perplexity (exp of the mean next-byte
cross-entropy over every window of the val split) and train_loss, and saves a checkpoint; the
report and checkpoint step is the number of optimizer steps done.
"""

import math

import torch
import torch.distributed as dist
from tiny_gpt import VOCAB_SIZE, TinyGPT, load_tokens, mean_loss, perplexity, windows
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from tunepod import runtime

DEFAULTS = {
    "lr": 3e-3,
    "lr_schedule": "cosine",
    "warmup_steps": 20,
    "weight_decay": 0.1,
    "n_layer": 2,
    "n_head": 4,
    "d_model": 64,
    "dropout": 0.0,
    "context": 64,
    "batch_size": 16,
    "steps": 300,
    "eval_interval": 50,
    "seed": 0,
}

# ---------------------------------------------------------------------------------------------- setup
ctx = runtime.init(DEFAULTS)
unknown = sorted(set(ctx.params) - set(DEFAULTS))
if unknown:
    raise SystemExit(f"unknown params {unknown}; valid params: {sorted(DEFAULTS)}")
params = ctx.params
if params["lr_schedule"] not in ("cosine", "constant"):
    raise SystemExit(f"lr_schedule must be cosine or constant, got {params['lr_schedule']!r}")

# Two processes share two cores here: more threads per process would only fight over them.
torch.set_num_threads(1)
torch.manual_seed(params["seed"])
distributed = ctx.world_size > 1
if distributed:
    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment

if not (ctx.data_dir / "train.bin").exists():
    if ctx.source != "local":
        raise SystemExit(f"no train.bin in {ctx.data_dir}; stage builtin://python-stdlib there first")
    from tunepod.staging.builtin import write_python_stdlib

    write_python_stdlib(ctx.data_dir)  # deterministic and atomic per file, so every rank may do it

train_tokens = load_tokens(ctx.data_dir, "train")
val_inputs, val_targets = windows(load_tokens(ctx.data_dir, "val"), params["context"])

# ---------------------------------------------------------------------------------------------- model
model_config = {
    "vocab_size": VOCAB_SIZE,
    "context": params["context"],
    "n_layer": params["n_layer"],
    "n_head": params["n_head"],
    "d_model": params["d_model"],
    "dropout": params["dropout"],
}
model = TinyGPT(**model_config)
# Decay the matrices only: decaying LayerNorm gains and biases towards zero only hurts.
decayed = [p for p in model.parameters() if p.dim() >= 2]
kept = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decayed, "weight_decay": params["weight_decay"]}, {"params": kept, "weight_decay": 0.0}],
    lr=params["lr"],
    betas=(0.9, 0.95),
)

start_step = 0
checkpoint = ctx.load_latest_checkpoint()
if checkpoint is not None:
    model.load_state_dict(checkpoint.state["model"])
    optimizer.load_state_dict(checkpoint.state["optimizer"])
    start_step = checkpoint.state["step"]
    if ctx.is_main:
        print(f"resuming from {checkpoint.path} at step {start_step}", flush=True)
trained = DistributedDataParallel(model) if distributed else model


def learning_rate(step):
    if params["lr_schedule"] == "constant":
        return params["lr"]
    if step < params["warmup_steps"]:
        return params["lr"] * (step + 1) / params["warmup_steps"]
    progress = (step - params["warmup_steps"]) / max(1, params["steps"] - params["warmup_steps"])
    return params["lr"] * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def batch(step):
    """This rank's windows for ``step``: a function of (seed, step, rank) alone, so a resumed run
    draws exactly the batches the killed one would have drawn."""
    generator = torch.Generator().manual_seed((params["seed"] * 1_000_003 + step) * ctx.world_size + ctx.rank)
    starts = torch.randint(
        len(train_tokens) - params["context"] - 1, (params["batch_size"],), generator=generator
    )
    offsets = torch.arange(params["context"])
    inputs = train_tokens[starts[:, None] + offsets]
    return inputs, train_tokens[starts[:, None] + offsets + 1]


def mean_over_ranks(value):
    if not distributed:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / ctx.world_size


# ---------------------------------------------------------------------------------------------- train
losses = []
val_perplexity = math.nan
for step in range(start_step, params["steps"]):
    trained.train()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step)
    inputs, targets = batch(step)
    loss = functional.cross_entropy(trained(inputs).flatten(0, 1), targets.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    losses.append(loss.item())

    done = step + 1
    # SIGTERM (preempted, requeued, pruned): evaluate and save this step now, then leave; it resumes here.
    stopping = ctx.should_stop()
    if done % params["eval_interval"] and done != params["steps"] and not stopping:
        continue
    train_loss = mean_over_ranks(sum(losses) / len(losses))
    losses = []
    # Every rank holds the same weights after the all-reduced step, so every rank gets the same value.
    val_perplexity = perplexity(mean_loss(model, val_inputs, val_targets))
    ctx.report(done, val_perplexity=val_perplexity, train_loss=train_loss)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": done,
        "model_config": model_config,
        "params": params,
    }
    ctx.save_checkpoint(state, done)
    if ctx.is_main:
        print(f"step {done}: train_loss {train_loss:.4f} val_perplexity {val_perplexity:.3f}", flush=True)
    if stopping:
        raise SystemExit(0)

if math.isnan(val_perplexity):  # resumed after the last step: score the checkpoint it resumed from
    val_perplexity = perplexity(mean_loss(model, val_inputs, val_targets))
ctx.finish(val_perplexity=val_perplexity)
if distributed:
    # Wait for rank 0's last checkpoint and result before anyone tears gloo down: a rank that leaves
    # while the others still hold connections can abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
