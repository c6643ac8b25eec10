"""The embedded demo zoo: small ViT classifiers trained on scikit-learn's bundled digits.

A generalisation measure is only interesting across models whose generalisation differs, and the demo must run offline.
So the zoo trains its own models on data that ship with scikit-learn: tiny ``ViTForImageClassification`` models (8x8
grey images, patches of 2 or 4 pixels, 1-2 layers) whose hyperparameters (learning rate, weight decay, width, epochs,
batch size, label noise) are drawn from a seeded generator, like the random hyperparameter search behind the paper's
model-soups zoo. Everything is deterministic: the same member config always trains the same weights on the same machine.

Cache layout (``$HF_GEOSHARP_CACHE/zoo``, default ``~/.cache/hf_geosharp/zoo``)::

    digits/            the train/test split as a ``datasets`` folder (``save_to_disk``): the data any face can load
    zoo-00/ ...        ``save_pretrained`` model + image processor + ``zoo_metrics.json`` (train/test loss and error)

A member folder appears atomically (trained in a temporary folder, then renamed), and it is reused only when its
recorded fingerprint matches its config, so an interrupted or outdated build is simply redone.

Training is chaotic: a last-bit difference in one matmul grows into a different model within a few hundred steps
(measured after 780 steps, 1 against 2 threads: relative weight distance 1.1 in float32, 0.35 in float64). Each
machine's kernels round differently (thread count, AVX2 or AVX-512, MKL's and oneDNN's own dispatch), so the zoo is
trained in a child process whose kernels are pinned to a portable baseline (:data:`PORTABLE_KERNELS`): on one
machine the same weights, bit for bit, whatever the caller's thread count and instruction set (checked by switching
the machine's kernels: AVX2 or AVX-512, MKL's instruction set, one or two threads; ``tests/test_leaderboard.py``).
Across machines: with the kernels of zoo version 2 an Intel Xeon and an AMD EPYC trained different zoos; version 3
also turns oneDNN off (its convolution picks its blocking from the CPU's cache sizes, whatever its instruction set),
and every member records a digest of its weights, which the demo prints, so that a run on another CPU shows at once
whether it trained the same zoo (docs/demo.md, "Across machines: check the digest").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from .durable import staged_dir, write_json, write_text
from .engine.progress import Stages, bar_disabled
from .portable import (  # noqa: F401  (run_portably, portable_result, weights_digest: re-exported)
    PORTABLE_KERNELS,
    kernels,
    portable_result,
    run_portably,
    weights_digest,
)

if TYPE_CHECKING:
    from transformers import ViTImageProcessorPil

logger = logging.getLogger(__name__)

ZOO_VERSION = 3  # bump when training changes, so that cached members are retrained (2: portable kernels, 3: no oneDNN)
N_TRAIN = 500  # of the 1797 digits; the remaining 1297 are the test split (small train set: real gaps)
SPLIT_SEED = 0
METRICS_FILE = "zoo_metrics.json"
DIGITS_DIR = "digits"
SPLIT_FILE = "zoo_split.json"
ZooSize = Literal["mini", "full"]


def cache_root() -> Path:
    """``$HF_GEOSHARP_CACHE`` or ``~/.cache/hf_geosharp``: where the zoo and its data live."""
    return Path(os.environ.get("HF_GEOSHARP_CACHE") or Path.home() / ".cache" / "hf_geosharp")


@dataclass(frozen=True)
class ZooMember:
    """One model of the zoo: its architecture and training recipe."""

    name: str
    hidden: int
    layers: int
    heads: int
    patch: int
    lr: float
    weight_decay: float
    epochs: int
    batch_size: int
    label_noise: float
    seed: int

    def fingerprint(self) -> str:
        """Changes whenever anything that determines the trained weights changes."""
        payload = json.dumps({**asdict(self), "zoo_version": ZOO_VERSION, "n_train": N_TRAIN}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def zoo_members(size: ZooSize | int = "full") -> list[ZooMember]:
    """The zoo's member configs: ``"full"`` (20 models, the demo), ``"mini"`` (4 fast models, tests) or a count.

    Hyperparameters are drawn from a seeded generator, with the number of optimiser steps capped so that the whole full
    zoo trains in minutes on two CPU cores (docs/demo.md). The mini zoo is hand-picked to span
    small and large gaps quickly.
    """
    if size == "mini":
        return [
            ZooMember("mini-00", 16, 1, 2, 4, 3e-3, 0.0, 4, 64, 0.0, 0),
            ZooMember("mini-01", 16, 1, 2, 4, 1e-2, 0.0, 12, 32, 0.3, 1),
            ZooMember("mini-02", 24, 1, 2, 2, 3e-3, 0.1, 6, 64, 0.1, 2),
            ZooMember("mini-03", 16, 2, 4, 4, 1e-3, 0.0, 2, 128, 0.0, 3),
        ]
    n = member_count(size, 20, "zoo")
    rng = np.random.default_rng(2025)
    members = []
    for i in range(n):
        hidden = int(rng.choice([16, 24, 32]))
        batch_size = int(rng.choice([16, 32, 64, 128]))
        max_epochs = max(3, 1000 * batch_size // N_TRAIN)  # at most ~1000 optimiser steps
        members.append(
            ZooMember(
                name=f"zoo-{i:02d}",
                hidden=hidden,
                layers=int(rng.choice([1, 2])),
                heads=int(rng.choice([2, 4])),
                patch=int(rng.choice([2, 4])),
                lr=float(rng.choice([1e-3, 3e-3, 1e-2])),
                weight_decay=float(rng.choice([0.0, 0.01, 0.1, 0.5])),
                epochs=int(rng.integers(3, max_epochs + 1)),
                batch_size=batch_size,
                label_noise=float(rng.choice([0.0, 0.0, 0.1, 0.25, 0.4])),
                seed=i,
            )
        )
    return members


def member_count(size: ZooSize | int, full: int, what: str) -> int:
    """How many members ``size`` (``"full"``, or a count; ``"mini"`` is each zoo's own list) names, or a clear error."""
    if size == "full" or (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        return full if size == "full" else int(size)
    raise ValueError(f"{what} size must be 'mini', 'full' or a positive integer, got {size!r}.")


# ------------------------------------------------------------------------------------------------------------ data


def digits_arrays() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The fixed train/test split of scikit-learn's digits as uint8 images (0-255) and labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(images))
    train, test = order[:N_TRAIN], order[N_TRAIN:]
    return {"train": (images[train], digits.target[train]), "test": (images[test], digits.target[test])}


def pixel_values(images: np.ndarray) -> torch.Tensor:
    """What the saved image processor produces from these images: ``[N, 1, 8, 8]`` scaled to [-1, 1]."""
    return torch.from_numpy((images.astype(np.float32) / 255.0 - 0.5) / 0.5)[:, None]


def image_processor() -> ViTImageProcessorPil:
    """Rescale to [0, 1] and normalise to [-1, 1]; no resizing (the images are already 8x8)."""
    from transformers import ViTImageProcessorPil

    return ViTImageProcessorPil(
        do_resize=False, size={"height": 8, "width": 8}, image_mean=[0.5], image_std=[0.5], rescale_factor=1 / 255
    )


def export_digits(folder: Path) -> Path:
    """Write the split as a ``datasets`` folder with ``image`` and ``label`` columns, unless it is already there
    (a folder written for another split, e.g. by an older version, is rewritten)."""
    split_id = json.dumps({"zoo_version": ZOO_VERSION, "n_train": N_TRAIN, "split_seed": SPLIT_SEED})
    marker = folder / SPLIT_FILE
    if marker.exists() and marker.read_text() == split_id:
        return folder
    import datasets
    from PIL import Image

    label_feature = datasets.ClassLabel(names=[str(d) for d in range(10)])
    features = datasets.Features({"image": datasets.Image(), "label": label_feature})
    splits = {
        name: datasets.Dataset.from_dict(
            {"image": [Image.fromarray(img) for img in images], "label": labels.tolist()}, features=features
        )
        for name, (images, labels) in digits_arrays().items()
    }
    with staged_dir(folder) as tmp:  # a reader never sees half a folder
        datasets.DatasetDict(splits).save_to_disk(str(tmp))
        write_text(tmp / SPLIT_FILE, split_id)
    return folder


# -------------------------------------------------------------------------------------------------------- training


def _noisy(labels: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Replace ``fraction`` of the labels by a different class, chosen at random."""
    flip = torch.rand(len(labels), generator=generator) < fraction
    shift = torch.randint(1, 10, (len(labels),), generator=generator)
    return torch.where(flip, (labels + shift) % 10, labels)


@torch.no_grad()
def _metrics(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    out = model(pixel_values=x, labels=y)
    return {"loss": float(out.loss), "error": float((out.logits.argmax(-1) != y).float().mean())}


def train_member(member: ZooMember, data: dict[str, tuple[np.ndarray, np.ndarray]], folder: Path) -> dict:
    """Train one member from its seed and save it (model, image processor, metrics) into ``folder``."""
    from transformers import ViTConfig, ViTForImageClassification

    generator = torch.Generator().manual_seed(member.seed)
    config = ViTConfig(
        image_size=8, patch_size=member.patch, num_channels=1, hidden_size=member.hidden,
        num_hidden_layers=member.layers, num_attention_heads=member.heads, intermediate_size=2 * member.hidden,
        num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)},
    )
    with torch.random.fork_rng(devices=[]):  # seeds the initial weights without touching the caller's RNG
        torch.manual_seed(member.seed)
        model = ViTForImageClassification(config)
    x_train, y_train = pixel_values(data["train"][0]), torch.as_tensor(data["train"][1])
    x_test, y_test = pixel_values(data["test"][0]), torch.as_tensor(data["test"][1])
    y_fit = _noisy(y_train, member.label_noise, generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=member.lr, weight_decay=member.weight_decay)
    model.train()
    for _ in range(member.epochs):
        order = torch.randperm(len(x_train), generator=generator)
        for start in range(0, len(order), member.batch_size):
            idx = order[start : start + member.batch_size]
            loss = model(pixel_values=x_train[idx], labels=y_fit[idx]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()
    train, test = _metrics(model, x_train, y_train), _metrics(model, x_test, y_test)
    metrics = {
        "member": asdict(member), "fingerprint": member.fingerprint(),
        "train_loss": train["loss"], "train_error": train["error"],
        "test_loss": test["loss"], "test_error": test["error"],
        "fit_loss": _metrics(model, x_train, y_fit)["loss"], "n_params": sum(p.numel() for p in model.parameters()),
        "weights_digest": weights_digest(model.state_dict()),
        "kernels": kernels(),
    }
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    write_json(folder / METRICS_FILE, metrics)
    return metrics


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run torch on ``n`` threads (default one): the zoo's tiny matmuls gain nothing from more, and on a busy machine
    extra threads spin and cost up to 15x (measured on a shared 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _cached(folder: Path, member: ZooMember) -> bool:
    try:
        return json.loads((folder / METRICS_FILE).read_text())["fingerprint"] == member.fingerprint()
    except (OSError, ValueError, KeyError):
        return False


@dataclass
class Zoo:
    """A built zoo: where its models and its data are."""

    root: Path
    members: list[ZooMember]

    @property
    def model_dirs(self) -> list[Path]:
        """Each member's model folder."""
        return [self.root / m.name for m in self.members]

    @property
    def data_dir(self) -> Path:
        """The bundled digits dataset the members were trained on."""
        return self.root / DIGITS_DIR

    def metrics(self) -> dict[str, dict]:
        """Each member's recorded train/test metrics, by name."""
        return {m.name: json.loads((self.root / m.name / METRICS_FILE).read_text()) for m in self.members}

    def weights_digest(self) -> str:
        """One digest of every member's weights (their recorded :func:`weights_digest`): equal on two machines
        exactly when they trained the same zoo."""
        digests = [self.metrics()[m.name]["weights_digest"] for m in self.members]
        return hashlib.sha256(" ".join(digests).encode()).hexdigest()[:12]


def build_zoo(
    size: ZooSize | int = "full",
    cache_dir: str | Path | None = None,
    progress: bool = True,
    names: list[str] | None = None,
) -> Zoo:
    """Train (or reuse from the cache) the members of the zoo and export the digits split next to them.

    Args:
        size: ``"full"`` (20 models, for the demo), ``"mini"`` (4 fast models, for tests) or a number of models.
        cache_dir: the zoo folder; default ``cache_root() / "zoo"``.
        progress: show a progress bar over the members.
        names: only these members (the Space trains just the model a visitor picks).
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "zoo"
    root.mkdir(parents=True, exist_ok=True)
    members = zoo_members(size)
    if names is not None:
        unknown = sorted(set(names) - {m.name for m in members})
        if unknown:
            raise ValueError(f"no zoo members named {unknown}; the {size!r} zoo has {[m.name for m in members]}.")
        members = [m for m in members if m.name in names]
    with _building(root):
        export_digits(root / DIGITS_DIR)
        todo = [m for m in members if not _cached(root / m.name, m)]
        if todo:
            logger.info("training %d of %d zoo models into %s (cached ones are reused)", len(todo), len(members), root)
            follow(train_portably(todo, root), [m.name for m in todo], "training zoo", progress)
    return Zoo(root, members)


def follow(results: Generator[dict, None, None], names: list[str], desc: str, progress: bool) -> None:
    """Consume a training child's metrics (one per name of ``names``, in order) under a progress bar, with a log's
    line as each model starts; an error or Ctrl-C stops the child first."""
    job = Stages(desc, len(names), "model", progress)  # a log's lines, one a model
    with tqdm(total=len(names), desc=desc, unit="model", disable=bar_disabled(progress)) as bar, \
            contextlib.closing(results):
        job.begin(names[0])
        for metrics in results:
            bar.update()
            job.update()
            if job.done < len(names):
                job.begin(names[job.done])
            logger.debug("%s trained: %s", metrics["member"]["name"], {k: v for k, v in metrics.items() if "_" in k})


def cached_members(size: ZooSize | int = "full", cache_dir: str | Path | None = None) -> list[str]:
    """The names of the members of the ``size`` zoo that are trained and cached (reused by the next build)."""
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "zoo"
    return [m.name for m in zoo_members(size) if _cached(root / m.name, m)]


STAGING = ".*-new-*"  # durable.staged_dir's folders: a member (or the digits) being written
LOCK_FILE = ".zoo.lock"


@contextlib.contextmanager
def _building(root: Path) -> Iterator[None]:
    """Hold the zoo folder's lock while building into it (a second build waits, then finds the members cached), and
    remove the staging folders of an interrupted or killed build, before and after: while the lock is held, no
    other build is writing one."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(root / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning("another process is building the zoo in %s; waiting for it to finish", root)
        lock.acquire()
    try:
        _remove_staging(root)
        yield
    finally:
        try:
            _remove_staging(root)
        finally:
            lock.release()


def _remove_staging(root: Path) -> None:
    for stale in root.glob(STAGING):
        if stale.is_dir():
            logger.debug("removing %s, left by an interrupted zoo build", stale)
            shutil.rmtree(stale, ignore_errors=True)


def train_portably(members: list[ZooMember], root: Path) -> Generator[dict, None, None]:
    """Train ``members`` into ``root/<name>`` in a child process on :data:`PORTABLE_KERNELS`; yields each member's
    metrics as it is saved."""
    yield from run_portably("hf_geosharp.zoo:_train_members_here",
                            {"root": str(root), "members": [asdict(m) for m in members]})


def _train_members_here(payload: dict) -> None:
    """The child's side of :func:`train_portably`: one metrics result per member."""
    data = digits_arrays()
    train_each(Path(payload["root"]), [ZooMember(**m) for m in payload["members"]], partial(train_member, data=data))


def train_each(root: Path, members: list, train: Callable[..., dict]) -> None:
    """The training child's loop: ``train(member, folder=...)`` into a staging folder renamed to ``root/<name>`` when
    done, then its metrics to the parent (:func:`portable_result`)."""
    for member in members:
        with staged_dir(root / member.name) as tmp:
            portable_result(train(member, folder=tmp))
