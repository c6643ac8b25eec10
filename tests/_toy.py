"""A tiny self-attention classifier with a hand-built symmetry map, independent of transformers and of the mapper."""

from __future__ import annotations

import torch
from torch import nn

from hf_geosharp.symmetry.base import PairBlock, SymmetryMap


class ToyAttention(nn.Module):
    """One multi-head self-attention layer (separate q/k/v with biases) plus a classifier head."""

    def __init__(self, d=8, heads=2, classes=3, seed=0, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(seed)
        self.d, self.heads, self.h = d, heads, d // heads
        self.embed = nn.Linear(4, d)
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.dropout = nn.Dropout(0.5)
        self.head = nn.Linear(d, classes)
        self.to(dtype)

    def forward(self, x, labels=None):
        b, t, _ = x.shape
        z = self.embed(x)
        split = lambda y: y.view(b, t, self.heads, self.h).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.query(z)), split(self.key(z)), split(self.value(z))
        att = torch.softmax(q @ k.transpose(-1, -2) / self.h**0.5, dim=-1)
        z = self.norm(z + self.dropout(self.out((att @ v).transpose(1, 2).reshape(b, t, self.d))))
        logits = self.head(z.mean(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def toy_symmetry_map(model: ToyAttention) -> SymmetryMap:
    """QK and VO pairs per head, with the q/k/v biases appended as a row (docs/spec.md §4.3)."""
    smap = SymmetryMap.empty(model)
    h = model.h

    def factor(name):  # [heads, d + 1, h]: W_torch row-slices transposed, bias appended
        W, b = smap.index_of(f"{name}.weight"), smap.index_of(f"{name}.bias")
        rows = [torch.cat([W[i * h : (i + 1) * h].T, b[None, i * h : (i + 1) * h]]) for i in range(model.heads)]
        return torch.stack(rows)

    W_o = smap.index_of("out.weight")
    O = torch.stack([W_o[:, i * h : (i + 1) * h] for i in range(model.heads)])
    smap.blocks = [PairBlock("qk", "attn", factor("query"), factor("key")), PairBlock("vo", "attn", factor("value"), O)]
    return smap


def toy_batches(n_batches=2, batch=6, seq=5, classes=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(batch, seq, 4, generator=g, dtype=dtype),
         "labels": torch.randint(0, classes, (batch,), generator=g)}
        for _ in range(n_batches)
    ]


def reparametrize_toy(model: ToyAttention, smap: SymmetryMap, condition=100.0, seed=1) -> None:
    """Apply a random GL(h) element per pair in place (the function is unchanged)."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for block in smap.blocks:
        k, _, h = block.G_index.shape
        U, _ = torch.linalg.qr(torch.randn(k, h, h, generator=g, dtype=flat.dtype))
        V, _ = torch.linalg.qr(torch.randn(k, h, h, generator=g, dtype=flat.dtype))
        s = torch.logspace(0, float(torch.log10(torch.tensor(condition))), h, dtype=flat.dtype)
        A = U @ torch.diag_embed(s.expand(k, h)) @ V.mT
        flat[block.G_index] = flat[block.G_index] @ torch.linalg.inv(A)
        flat[block.H_index] = flat[block.H_index] @ A.mT
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
