"""Tiny random-init models, their processors and labelled data, shared by the evaluate, CLI and distributed tests.

Sizes are minimal so that a solver run costs milliseconds on two shared CPU cores; everything is seeded, so two
processes building the same fixture get bit-identical weights.
"""

from __future__ import annotations

import csv
import random
import string
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a shared two-core machine, spinning OpenMP threads make tiny models 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["good", "bad", "great", "awful", "film", "plot", "actor", "boring", "fun", "dull", "the", "a", "was", "is"]
VOCAB = SPECIALS + list(string.ascii_lowercase) + [f"##{c}" for c in string.ascii_lowercase] + WORDS
assert len(VOCAB) <= 100


def tiny_bert(num_labels: int = 2, seed: int = 0) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config).eval()


def tiny_tokenizer(folder: Path):
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), model_max_length=64)


def tiny_vit(num_labels: int = 3, seed: int = 0) -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return ViTForImageClassification(config).eval()


def tiny_image_processor():
    from transformers import ViTImageProcessor

    return ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def sentences(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """Short made-up reviews with a label that depends on the words (so the data is not pure noise)."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 9))]
        texts.append(" ".join(words))
        score = sum(w in ("good", "great", "fun") for w in words) - sum(w in ("bad", "awful", "dull") for w in words)
        labels.append(int(score > 0))
    return texts, labels


def save_text_model(folder: Path, seed: int = 0) -> Path:
    """A saved tiny BertForSequenceClassification with its tokenizer: what ``geosharp run --model`` reads."""
    tiny_bert(seed=seed).save_pretrained(folder)
    tiny_tokenizer(folder).save_pretrained(folder)
    return folder


def save_vision_model(folder: Path, seed: int = 0) -> Path:
    tiny_vit(seed=seed).save_pretrained(folder)
    tiny_image_processor().save_pretrained(folder)
    return folder


def write_csv(path: Path, n: int, *, with_labels: bool = True, seed: int = 0) -> Path:
    texts, labels = sentences(n, seed)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "label"] if with_labels else ["review"])
        for t, y in zip(texts, labels):
            writer.writerow([t, y] if with_labels else [t])
    return path


def write_imagefolder(folder: Path, per_class: int, n_classes: int = 3, seed: int = 0) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(n_classes):
        (folder / f"class{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = (rng.random((8, 8, 3)) * 255 * (c + 1) / n_classes).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"class{c}" / f"{i}.png")
    return folder
