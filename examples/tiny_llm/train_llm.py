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
cross-entropy over every window of the val split), train_loss and tokens_per_s (the job's training
throughput: tokens of every data rank's batches per second of training steps, evaluation left out),
and saves a checkpoint; the report and checkpoint step is the number of optimizer steps done. Each
rank also times its steps for tunepod's per-rank telemetry (ctx.step_done).

The job's layout (ctx.parallelism, from the spec's train.parallelism) picks how the processes split
the work. data x 1 x 1 with sharding none is plain DDP. Anything else builds ctx.device_mesh() and
applies, in torchtitan's order: pipeline stages over mesh["pp"] (GPipe over micro-batches), tensor
parallelism over mesh["tp"], FSDP2 over the data axis (sharding full; hybrid: HSDP over
(dp_replicate, dp_shard); none: gradients averaged over mesh["dp"]). Those layouts save sharded,
asynchronous checkpoints (every rank its shard of the model and AdamW state) and resume from them.
Batches are a function of (seed, step, data rank): every tensor and pipeline rank of a data rank
draws the same one, and a resumed run draws exactly what the killed one would have.

On SageMaker, tunepod hands a layout with tensor parallelism (or hybrid sharding) to SageMaker's
model parallelism library v2 too (the mp_parameters hyperparameter, on SMP's own image): the script
then initialises SMP first (under_smp), and splits its tensors over the same DeviceMesh as
everywhere else (SMP's own tsm.transform only knows Hugging Face models). Elsewhere nothing changes.
"""

import importlib.util
import math
import os
import time

import torch
import torch.distributed as dist
from tiny_gpt import (
    VOCAB_SIZE,
    TinyGPT,
    clip_grad_norm,
    fully_shard_model,
    load_tokens,
    loss_sum,
    mean_loss,
    perplexity,
    pipeline_stage,
    tensor_parallel,
    windows,
)
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
layout = ctx.parallelism
if params["n_head"] % layout.tensor:
    raise SystemExit(
        f"n_head {params['n_head']} is not divisible by parallelism.tensor {layout.tensor}: each tensor rank"
        " computes n_head / tensor whole heads; fix: pick n_head a multiple of tensor"
    )
if layout.pipeline > params["n_layer"]:
    raise SystemExit(
        f"parallelism.pipeline {layout.pipeline} needs n_layer >= {layout.pipeline} (a block per stage)"
    )
if params["batch_size"] % layout.pipeline:
    raise SystemExit(
        f"batch_size {params['batch_size']} must split into {layout.pipeline} pipeline micro-batches"
    )


def under_smp() -> bool:
    """Whether SageMaker runs this job under SMP v2: it passes mp_parameters as SM_HP_MP_PARAMETERS, and
    only SMP's image has torch.sagemaker."""
    return "SM_HP_MP_PARAMETERS" in os.environ and importlib.util.find_spec("torch.sagemaker") is not None


if under_smp():
    import torch.sagemaker as tsm

    tsm.init()  # SMP v2 reads its configuration (mp_parameters) and sets up its process groups

# Plain data parallelism (DDP, as without a layout) unless the layout shards, splits tensors or stages.
plain_ddp = layout.sharding == "none" and layout.tensor == 1 and layout.pipeline == 1

# Two processes share two cores here: more threads per process would only fight over them.
torch.set_num_threads(1)
torch.manual_seed(params["seed"])
distributed = ctx.world_size > 1
if plain_ddp:
    if distributed:
        dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment
    dp_rank, dp_size = ctx.rank, ctx.world_size
    last_stage = True
else:
    mesh = ctx.device_mesh()  # starts the gloo process group too
    if layout.sharding == "hybrid":  # a 2-D data axis; mesh["dp"] flattens it (replicate, shard) row-major
        dp_rank = mesh.get_local_rank("dp_replicate") * layout.shard + mesh.get_local_rank("dp_shard")
    else:
        dp_rank = mesh.get_local_rank("dp")
    dp_size = layout.data
    pp_rank = mesh["pp"].get_local_rank()
    first_stage, last_stage = pp_rank == 0, pp_rank == layout.pipeline - 1

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
    # Pipeline stages put the embedding and the output layer on different ranks: untie them there.
    "tied": layout.pipeline == 1,
}
model = TinyGPT(**model_config)
if not plain_ddp:
    if layout.pipeline > 1:
        pipeline_stage(model, pp_rank, layout.pipeline)
    if layout.tensor > 1:
        tensor_parallel(model, mesh["tp"])
    if layout.sharding != "none":
        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.sharding == "hybrid" else mesh["dp"]
        # Under a pipeline a stage runs several micro-batches a step: keep its weights gathered.
        fully_shard_model(model, dp_mesh, reshard_after_forward=layout.pipeline == 1)
# Decay the matrices only: decaying LayerNorm gains and biases towards zero only hurts.
decayed = [p for p in model.parameters() if p.dim() >= 2]
kept = [p for p in model.parameters() if p.dim() < 2]
# DTensor parameters: one fused kernel per group instead of a dozen dispatched ops per parameter. But
# tensor parallelism without FSDP2 leaves the parameters it does not split (norms, embeddings) plain
# tensors, and a fused (or foreach) kernel refuses a group that mixes them with DTensors
# ("aten._fused_adamw_.default got mixed torch.Tensor and DTensor"): those step one parameter at a time.
mixed = len({type(parameter).__name__ == "DTensor" for parameter in model.parameters()}) > 1
optimizer = torch.optim.AdamW(
    [{"params": decayed, "weight_decay": params["weight_decay"]}, {"params": kept, "weight_decay": 0.0}],
    lr=params["lr"],
    betas=(0.9, 0.95),
    fused=None if plain_ddp or mixed else True,
    foreach=False if mixed else None,
)


def sharded_state(step):
    """The model's and AdamW's state as DTensor shards (this rank's part), for a sharded save or load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, moments = get_state_dict(model, optimizer)
    return {
        "model": weights,
        "optimizer": moments,
        "step": step,
        "model_config": model_config,
        "params": params,
    }


start_step = 0
if plain_ddp:
    checkpoint = ctx.load_latest_checkpoint()
    if checkpoint is not None:
        model.load_state_dict(checkpoint.state["model"])
        optimizer.load_state_dict(checkpoint.state["optimizer"])
        start_step = checkpoint.state["step"]
else:
    # Each rank reads its own shards into the state dict, resharded if the checkpoint's layout differs.
    from torch.distributed.checkpoint.state_dict import set_state_dict

    loaded = sharded_state(0)
    checkpoint = ctx.load_latest_checkpoint(into=loaded)
    if checkpoint is not None:
        if checkpoint.state is not loaded:
            raise SystemExit(
                f"{checkpoint.path} is a whole (DDP) checkpoint; this layout resumes sharded ones only"
            )
        set_state_dict(
            model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
        )
        start_step = loaded["step"]
if checkpoint is not None and ctx.is_main:
    print(f"resuming from {checkpoint.path} at step {start_step}", flush=True)
trained = DistributedDataParallel(model) if plain_ddp and distributed else model


def learning_rate(step):
    if params["lr_schedule"] == "constant":
        return params["lr"]
    if step < params["warmup_steps"]:
        return params["lr"] * (step + 1) / params["warmup_steps"]
    progress = (step - params["warmup_steps"]) / max(1, params["steps"] - params["warmup_steps"])
    return params["lr"] * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def batch(step):
    """This data rank's windows for ``step``: a function of (seed, step, data rank) alone, so a resumed
    run draws exactly the batches the killed one would have drawn, and the tensor and pipeline ranks
    of one data rank draw the same (under DDP the data rank is the rank)."""
    generator = torch.Generator().manual_seed((params["seed"] * 1_000_003 + step) * dp_size + dp_rank)
    starts = torch.randint(
        len(train_tokens) - params["context"] - 1, (params["batch_size"],), generator=generator
    )
    offsets = torch.arange(params["context"])
    inputs = train_tokens[starts[:, None] + offsets]
    return inputs, train_tokens[starts[:, None] + offsets + 1]


def mean_over_ranks(value, count=1):
    """The mean over every rank of ``value`` (a sum over ``count`` items). Every tensor rank of a data
    rank holds the same value, which leaves the mean as it is; under a pipeline only the last stage
    has one, and the others pass a count of 0."""
    if not distributed:
        return value / count
    total = torch.tensor([value, count], dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def max_over_ranks(value):
    if not distributed:
        return value
    largest = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


if not plain_ddp and layout.pipeline > 1:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    def microbatch_loss(logits, targets):
        # The schedule back-propagates each micro-batch's loss: scaled so that their sum is the batch mean.
        return functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) / layout.pipeline

    pp_group = mesh["pp"].get_group()
    schedule = ScheduleGPipe(
        PipelineStage(model, pp_rank, layout.pipeline, torch.device("cpu"), group=pp_group),
        n_microbatches=layout.pipeline,
        loss_fn=microbatch_loss,
    )


def train_step(inputs, targets):
    """Forward and backward of one batch; the batch's mean loss (0.0 on pipeline stages but the last)."""
    if plain_ddp or layout.pipeline == 1:
        loss = functional.cross_entropy(trained(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return loss.item()
    optimizer.zero_grad(set_to_none=True)
    losses = []
    if first_stage:
        schedule.step(inputs)
    elif last_stage:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    return sum(loss.item() for loss in losses)


def average_gradients():
    """sharding none under tensor or pipeline parallelism: the data ranks' gradients averaged by hand
    (what DDP does; DDP itself does not take DTensor parameters)."""
    from torch.distributed.tensor import DTensor

    for parameter in model.parameters():
        if parameter.grad is not None:
            grad = parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad
            dist.all_reduce(grad, group=mesh["dp"].get_group())
            grad /= dp_size


def validation_loss():
    """The mean val loss, the same on every rank. Under DDP every rank scores every window. Otherwise
    each data rank scores its share, and every rank takes part (FSDP gathers weights, TP
    all-reduces activations, a pipeline passes them on) in as many forward calls as the others."""
    if plain_ddp:
        return mean_loss(model, val_inputs, val_targets)
    inputs, targets = val_inputs.tensor_split(dp_size)[dp_rank], val_targets.tensor_split(dp_size)[dp_rank]
    if layout.pipeline == 1:
        batches = math.ceil(len(val_inputs) / dp_size / 256)
        return mean_over_ranks(loss_sum(model, inputs, targets, batches), targets.numel())
    model.eval()
    total, count = 0.0, 0
    size = 64 * layout.pipeline  # whole batches only: the stages expect one micro-batch shape
    with torch.no_grad():
        for start in range(0, len(val_inputs) // dp_size - size + 1, size):
            kept = []
            if first_stage:
                schedule.eval(inputs[start : start + size])
            elif last_stage:
                schedule.eval(target=targets[start : start + size], losses=kept)
                count += targets[start : start + size].numel()
            else:
                schedule.eval()
            # Each micro-batch's loss is its mean over the batch's micro-batches (see microbatch_loss).
            total += sum(loss.item() for loss in kept) * size * params["context"]
    return mean_over_ranks(total, count)


# ---------------------------------------------------------------------------------------------- train
losses = []
val_perplexity = math.nan
# Tokens per optimizer step over the whole job: each data replica trains on its own batch.
tokens_per_step = params["batch_size"] * params["context"] * layout.data
training_s, trained_steps = 0.0, 0
for step in range(start_step, params["steps"]):
    step_started = time.perf_counter()
    trained.train()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step)
    inputs, targets = batch(step)
    losses.append(train_step(inputs, targets))
    if plain_ddp:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        if layout.sharding == "none" and dp_size > 1:
            average_gradients()
        clip_grad_norm(list(model.parameters()), 1.0, replicas=layout.data * layout.tensor)
    optimizer.step()

    done = step + 1
    training_s += time.perf_counter() - step_started
    trained_steps += 1
    # This rank's share of the step's work: the tensor and pipeline ranks of a data rank split its batch.
    share = layout.tensor * layout.pipeline
    ctx.step_done(done, samples=len(inputs) / share, tokens=inputs.numel() / share)
    # SIGTERM (preempted, requeued, pruned): evaluate and save this step now, then leave; it resumes here.
    stopping = ctx.should_stop()
    if done % params["eval_interval"] and done != params["steps"] and not stopping:
        continue
    # Under a pipeline only the last stage has the loss.
    train_loss = mean_over_ranks(sum(losses) / len(losses), 1 if plain_ddp or last_stage else 0)
    losses = []
    # Every rank holds the same weights after the all-reduced step, so every rank gets the same value.
    val_perplexity = perplexity(validation_loss())
    # The slowest rank's time: the ranks step in lockstep, so it is the job's.
    tokens_per_s = tokens_per_step * trained_steps / max_over_ranks(training_s)
    ctx.report(done, val_perplexity=val_perplexity, train_loss=train_loss, tokens_per_s=tokens_per_s)
    if plain_ddp:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": done,
            "model_config": model_config,
            "params": params,
        }
        ctx.save_checkpoint(state, done)
    else:  # written and committed in the background while training goes on (finish waits for it)
        ctx.save_checkpoint(sharded_state(done), done, sharded=True, async_save=True)
    if ctx.is_main:
        print(f"step {done}: train_loss {train_loss:.4f} val_perplexity {val_perplexity:.3f}", flush=True)
    if stopping:
        ctx.wait_for_checkpoint()
        raise SystemExit(0)

if math.isnan(val_perplexity):  # resumed after the last step: score the checkpoint it resumed from
    val_perplexity = perplexity(validation_loss())
# tokens_per_s was reported with the last step; a run that resumed after it trained nothing to time,
# and tunepod then takes the value its last report gave.
ctx.finish(val_perplexity=val_perplexity)
if distributed:
    # Wait for rank 0's last checkpoint and result before anyone tears gloo down: a rank that leaves
    # while the others still hold connections can abort ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
