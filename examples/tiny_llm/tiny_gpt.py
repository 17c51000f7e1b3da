"""A tiny decoder-only transformer over bytes, and the data helpers train_llm.py and evaluate_llm.py share.

The model is GPT-shaped: token and position embeddings, pre-norm blocks of causal self-attention and
an MLP, a final LayerNorm, and an output layer tied to the token embedding. The tokenizer is the
identity on bytes: token i is byte i, so the vocabulary is 256 and a model that guesses uniformly
has perplexity 256.
"""

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.nn import functional

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

VOCAB_SIZE = 256


def load_tokens(data_dir: Path, split: str) -> torch.Tensor:
    """The bytes of ``<data_dir>/<split>.bin`` as a 1-D int64 tensor of token ids."""
    data = np.frombuffer((data_dir / f"{split}.bin").read_bytes(), dtype=np.uint8)
    return torch.from_numpy(data.astype(np.int64))


def windows(tokens: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every non-overlapping window of ``context`` tokens, as inputs and next-token targets."""
    count = (len(tokens) - 1) // context
    inputs = tokens[: count * context].view(count, context)
    targets = tokens[1 : count * context + 1].view(count, context)
    return inputs, targets


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_head ({n_head})")
        self.head_width = d_model // n_head
        self.dropout = dropout
        # Three projections rather than one fused qkv: tensor parallelism splits each by output
        # features, so every rank gets whole heads of q, k and v (a fused one would split into q | k).
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # (batch, length, width) -> (batch, heads, length, head width); under tensor parallelism
        # width and heads are this rank's share, hence -1.
        q, k, v = (
            p(x).view(batch, length, -1, self.head_width).transpose(1, 2)
            for p in (self.query, self.key, self.value)
        )
        dropout = self.dropout if self.training else 0.0
        y = functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.out_dropout(self.out(y.transpose(1, 2).reshape(batch, length, -1)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.attention_norm = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_head, dropout)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """``forward(tokens)`` maps (batch, length <= context) token ids to (batch, length, vocab) logits.

    ``tied=False`` gives the output layer its own weight (pipeline stages: see ``pipeline_stage``).
    A pipeline stage holds only its own parts: the first the embeddings, the last the final norm
    and the output layer, each its share of the blocks; the others are ``None`` or ``nn.Identity``.
    """

    def __init__(
        self,
        vocab_size: int,
        context: int,
        n_layer: int,
        n_head: int,
        d_model: int,
        dropout: float,
        tied: bool = True,
    ):
        super().__init__()
        self.context = context
        self.n_head = n_head
        self.token_embedding: nn.Embedding | None = nn.Embedding(vocab_size, d_model)
        self.position_embedding: nn.Embedding | None = nn.Embedding(context, d_model)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.final_norm: nn.LayerNorm | None = nn.LayerNorm(d_model)
        self.head: nn.Linear | None = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)
        if tied:
            # Tied weights: fewer parameters, and the usual choice for small language models.
            self.head.weight = self.token_embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        if self.token_embedding is not None and self.position_embedding is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.embedding_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        if self.final_norm is not None and self.head is not None:
            x = self.head(self.final_norm(x))
        return x

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Greedy continuation of the 1-D ``prompt`` by ``num_tokens`` tokens (prompt included)."""
        tokens = prompt.clone()
        for _ in range(num_tokens):
            logits = self(tokens[-self.context :].unsqueeze(0))
            tokens = torch.cat([tokens, logits[0, -1].argmax().view(1)])
        return tokens


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


@torch.no_grad()
def mean_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 256) -> float:
    """The mean next-token cross-entropy (nats) of ``model`` over the given windows, in eval mode."""
    model.eval()
    total = 0.0
    for start in range(0, len(inputs), batch_size):
        logits = model(inputs[start : start + batch_size])
        batch_targets = targets[start : start + batch_size]
        total += functional.cross_entropy(
            logits.flatten(0, 1), batch_targets.flatten(), reduction="sum"
        ).item()
    return total / targets.numel()


@torch.no_grad()
def loss_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batches: int) -> float:
    """The summed next-token cross-entropy (nats) of ``model`` over the windows, in ``batches`` forward
    calls, in eval mode: under FSDP every rank must make as many calls as the others."""
    model.eval()
    total = 0.0
    for batch_inputs, batch_targets in zip(
        inputs.tensor_split(batches), targets.tensor_split(batches), strict=True
    ):
        logits = model(batch_inputs)
        total += functional.cross_entropy(
            logits.flatten(0, 1), batch_targets.flatten(), reduction="sum"
        ).item()
    return total


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy in nats)."""
    return math.exp(loss)


# ------------------------------------------------------------------------------ parallel layouts
# train_llm.py applies these in torchtitan's order: split into pipeline stages, then tensor
# parallelism inside each stage, then FSDP2 over the data axis.


def pipeline_stage(model: TinyGPT, stage: int, stages: int) -> TinyGPT:
    """``model`` cut down, in place, to pipeline stage ``stage`` of ``stages``: a contiguous share of the
    blocks (the others become ``nn.Identity``, so parameter names stay those of the whole model and
    each stage's checkpoint shard has its own keys), the embeddings on the first stage, the final
    norm and output layer on the last. The model must be untied (``tied=False``): the embedding
    and the output layer live on different ranks."""
    head, embedding = model.head, model.token_embedding
    if head is not None and embedding is not None and head.weight is embedding.weight:
        raise ValueError(
            "pipeline stages need TinyGPT(tied=False): the embedding and head are on other ranks"
        )
    n_layer = len(model.blocks)
    if not 1 <= stages <= n_layer:
        raise ValueError(f"pipeline {stages} needs at least as many blocks, n_layer is {n_layer}")
    first, last = stage * n_layer // stages, (stage + 1) * n_layer // stages
    for index in range(n_layer):
        if not first <= index < last:
            model.blocks[index] = nn.Identity()
    if stage > 0:
        model.token_embedding = model.position_embedding = None
    if stage < stages - 1:
        model.final_norm = model.head = None
    return model


def tensor_parallel(model: TinyGPT, tp_mesh: "DeviceMesh") -> None:
    """Megatron-style tensor parallelism of every block over ``tp_mesh``: q, k, v and the MLP's up
    projection split by output features (whole heads per rank), the attention output and the MLP's
    down projection by input features, so each block costs two all-reduces forward.

    The embeddings, norms and output layer stay plain tensors, whole on every tensor rank: at a
    vocabulary of 256 splitting them saves nothing. That keeps the tie too: the embedding and the
    output layer share one replicated parameter, which fully_shard then shards over the data axis
    alone, and both users sit in the root's FSDP group, as FSDP2 requires of a shared parameter.
    (A vocabulary-parallel head would shard the embedding by rows and need a parallel loss.)"""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tensor = tp_mesh.size()
    if model.n_head % tensor:
        raise ValueError(
            f"n_head {model.n_head} is not divisible by tensor {tensor}: a tensor rank computes whole heads"
        )
    plan = {
        "attention.query": ColwiseParallel(),
        "attention.key": ColwiseParallel(),
        "attention.value": ColwiseParallel(),
        "attention.out": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(),
    }
    for block in model.blocks:
        if isinstance(block, Block):
            parallelize_module(block, tp_mesh, plan)


def fully_shard_model(model: TinyGPT, dp_mesh: "DeviceMesh", reshard_after_forward: bool = True) -> None:
    """FSDP2 over ``dp_mesh``: each block its own group (gathered just before it runs, freed after),
    then the root for the rest (embeddings, final norm, output layer). A 2-D ``dp_mesh``
    (dp_replicate, dp_shard) gives HSDP: sharded inside a group, replicated across groups."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        if isinstance(block, Block):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, replicas: int) -> float:
    """``clip_grad_norm_`` over every rank of the job with one all-reduce; returns the total norm.

    torch's own stacks the parameters' norms, which under TP x FSDP fails ("All operands in
    aten.stack.default must have the same mesh": the blocks' DTensors are on (dp, tp), the rest on
    dp alone), and a pipeline stage holds only its own parameters. So each rank sums the
    squares of its local gradient shards, each divided by how many ranks hold that same shard
    (``replicas``, the data x tensor ranks of a stage, over the number of shards of the gradient),
    and one all-reduce over the job adds them up: stages, shards and replicas alike.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    grads = [p.grad for p in parameters if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        local, shards = grad, 1
        if isinstance(grad, DTensor):
            local = grad.to_local()
            for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
                shards *= size if isinstance(placement, Shard) else 1
        squares += local.double().square().sum() * shards / replicas
    if dist.is_initialized():
        dist.all_reduce(squares)
    total = math.sqrt(squares.item())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return total
