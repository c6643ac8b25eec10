"""Benchmark workloads: randomly initialised BERT classifiers, their batches and their symmetry maps.

Random init is enough for timing and memory: the cost of a solver step does not depend on the weights' values. The
symmetry map comes from ``gs.map_symmetries`` (the library's mapper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import BertConfig, BertForSequenceClassification

from hf_geosharp.symmetry import SymmetryMap, map_symmetries

if TYPE_CHECKING:
    from .config import Workload


@dataclass(frozen=True)
class ModelSize:
    """A BERT shape. ``name`` appears in the JSON results and tables."""

    name: str
    layers: int
    hidden: int
    heads: int

    @property
    def intermediate(self) -> int:
        return 4 * self.hidden


MINILM = ModelSize("minilm-6x384x12", 6, 384, 12)
BERT_BASE = ModelSize("bert-base-12x768x12", 12, 768, 12)
SIZES = {"minilm": MINILM, "base": BERT_BASE}


def bert_classifier(
    size: ModelSize, *, seed: int = 0, device: str = "cpu", num_labels: int = 3
) -> BertForSequenceClassification:
    """A random-init ``BertForSequenceClassification`` of the given shape, in eval mode (dropout off).

    Biases get small random values: ``transformers`` initialises them to 0, and adaptive sharpness freezes zero
    weights, so the solvers would skip their gradients while a plain backward computes them. A trained model has no
    zero biases; neither does this one, so solver and floor do the same work."""
    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.intermediate,
        num_labels=num_labels,
    )
    model = BertForSequenceClassification(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model.to(device).eval()


def bert_batches(
    model: BertForSequenceClassification, *, n_batches: int, batch_size: int, seq_len: int, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Random token ids and labels on the model's device; full attention masks (worst case for compute)."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    vocab, labels = model.config.vocab_size, model.config.num_labels
    return [
        {
            "input_ids": torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device),
            "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long, device=device),
            "labels": torch.randint(0, labels, (batch_size,), generator=g).to(device),
        }
        for _ in range(n_batches)
    ]


def symmetry_map(model: BertForSequenceClassification) -> tuple[SymmetryMap, str]:
    """The library's map of the model, and its source (recorded in the JSON results)."""
    return map_symmetries(model), "hf_geosharp.symmetry.map_symmetries"


def workload_inputs(
    w: Workload, device: str
) -> tuple[BertForSequenceClassification, list[dict[str, torch.Tensor]], SymmetryMap, str]:
    """The model, batches and symmetry map (with where it came from) of one benchmark workload."""
    model = bert_classifier(SIZES[w.size], device=device)
    batches = bert_batches(model, n_batches=w.n_batches, batch_size=w.batch_size, seq_len=w.seq_len)
    smap, source = symmetry_map(model)
    return model, batches, smap, source

