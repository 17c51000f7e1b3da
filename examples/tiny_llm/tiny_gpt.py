"""A tiny decoder-only transformer over bytes, and the data helpers train_llm.py and evaluate_llm.py share.

The model is GPT-shaped: token and position embeddings, pre-norm blocks of causal self-attention and
an MLP, a final LayerNorm, and an output layer tied to the token embedding. The tokenizer is the
identity on bytes: token i is byte i, so the vocabulary is 256 and a model that guesses uniformly
has perplexity 256.
"""

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional

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
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, length, width) -> (batch, heads, length, head width)
        q, k, v = (t.view(batch, length, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.out_dropout(self.out(y.transpose(1, 2).reshape(batch, length, width)))


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
    """``forward(tokens)`` maps (batch, length <= context) token ids to (batch, length, vocab) logits."""

    def __init__(
        self, vocab_size: int, context: int, n_layer: int, n_head: int, d_model: int, dropout: float
    ):
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.embedding_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        # Tied weights: fewer parameters, and the usual choice for small language models.
        self.head.weight = self.token_embedding.weight
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding_dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

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


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy in nats)."""
    return math.exp(loss)
