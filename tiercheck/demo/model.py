"""The demo's model and data: a tiny byte-level transformer on real text.

The text is Python's own standard library, read from this machine's installation: real
prose-and-code, present wherever Python is, nothing to download or ship. Batches are a pure
function of (step, rank), so a run resumed from a checkpoint sees exactly the data an
uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["TinyLM", "batch", "corpus", "digest"]

_CORPUS_BYTES = 1 << 20


def corpus(limit: int = _CORPUS_BYTES) -> torch.Tensor:
    """Up to ``limit`` bytes of the standard library's sources, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    size = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    text = b"".join(chunks)[:limit]
    if len(text) < 4096:  # a Python without its sources: generate some text instead
        text = b"".join(f"line {i}: the quick brown fox {i * i}\n".encode() for i in range(8192))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batch(
    text: torch.Tensor, step: int, rank: int, size: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of one rank at one step: deterministic, independent of history."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    starts = torch.randint(0, text.numel() - length - 1, (size,), generator=g)
    rows = torch.stack([text[s : s + length + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


class TinyLM(nn.Module):
    """A small causal transformer over bytes (dropout on, so RNG state matters on resume)."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, length: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.zeros(length, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=4 * dim, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)
        mask = torch.triu(torch.full((length, length), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for the next byte at every position."""
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        mask: torch.Tensor = self.mask  # type: ignore[assignment]
        return self.head(self.blocks(x, mask=mask[:n, :n], is_causal=True))  # type: ignore[no-any-return]


def digest(state: Any) -> str:
    """A hash of every tensor's bytes in a nested state (and of its other leaves, as text)."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(state)
    return h.hexdigest()
