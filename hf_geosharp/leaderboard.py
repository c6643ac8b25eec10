"""Leaderboards: rank many models by sharpness and ask whether sharpness predicts their generalisation gap.

A generalisation measure is judged by how well it ranks models, so the leaderboard measures every model on the same
batches, correlates every measure with the gap (Kendall tau, as in the paper's Section 5, with bootstrap 95 % intervals)
and always puts two trivial predictors beside the sharpness measures, the parameter norm and the clean training loss:
a measure that does not beat them tells the reader little.

Long runs must survive being killed, so every number goes into a :class:`~hf_geosharp.store.ResultStore` the moment
it is computed, keyed by a fingerprint of the content of the model and the data (:mod:`hf_geosharp.store`). A rerun
with the same settings skips every finished (model, measure) and only computes what is missing. Every output file is
written durably (:mod:`hf_geosharp.durable`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from scipy import stats
from tqdm.auto import tqdm

from .api import SharpnessResult, adaptive_sharpness, collected_convergence_notes, geodesic_sharpness
from .data import DataError, DataSpec, load_batches, load_model, load_processor, load_split, require_task
from .durable import atomic_path, write_json, write_text
from .relative_flatness import relative_flatness
from .store import ResultStore, data_identity, fingerprint, model_identity

logger = logging.getLogger(__name__)

Kind = Literal["inv", "mix", "adaptive", "relative_flatness"]
Mode = Literal["worst", "average"]
GapMetric = Literal["error", "loss"]
KINDS: tuple[Kind, ...] = ("inv", "mix", "adaptive", "relative_flatness")
TRIVIAL = ("param_norm", "clean_loss")  # the baselines every measure must beat
MIN_MODELS_FOR_CI = 8
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# ----------------------------------------------------------------------------------------------------- what to run


@dataclass(frozen=True)
class ModelRef:
    """A model to rank: its display name and where ``from_pretrained`` finds it (a folder or a Hub id)."""

    name: str
    source: str


def resolve_models(specs: Iterable[str]) -> list[ModelRef]:
    """Model folders, folders of checkpoint folders, text files listing models (one per line) and Hub ids."""
    sources: list[str] = []

    def add(spec: str, base: Path, reading: tuple[Path, ...]) -> None:
        path = Path(spec) if Path(spec).is_absolute() else base / spec
        if path.is_file():
            here = path.resolve()
            if here in reading:
                chain = " -> ".join(str(p) for p in (*reading, here))
                raise DataError(f"the model list {str(path)!r} includes itself ({chain}); remove that line.")
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except UnicodeDecodeError:
                raise DataError(f"the model list {str(path)!r} is not UTF-8 text; save it as UTF-8, one model per "
                                "line.") from None
            for line in lines:
                if line.strip() and not line.lstrip().startswith("#"):
                    add(line.strip(), path.parent, (*reading, here))
        elif (path / "config.json").is_file():
            sources.append(str(path.resolve()))
        elif path.is_dir():
            found = sorted(p for p in path.iterdir() if (p / "config.json").is_file())
            if not found:
                raise DataError(f"folder {str(path)!r} holds no model: neither it nor a sub-folder has a config.json.")
            sources.extend(str(p.resolve()) for p in found)
        elif _HUB_ID.match(spec):
            sources.append(spec)
        else:
            raise DataError(f"{spec!r} is neither a model folder, a folder of checkpoints, a list file nor a Hub id.")

    for spec in specs:
        add(spec, Path.cwd(), ())
    if not sources:
        raise DataError("no models to rank; pass model folders, a folder of checkpoints, a list file or Hub ids.")
    sources = list(dict.fromkeys(sources))
    names = [Path(s).name if os.path.isabs(s) else s for s in sources]
    if len(set(names)) < len(names):  # same folder name in different places: show more of the path
        common = os.path.commonpath([s for s in sources if os.path.isabs(s)] or ["/"])
        names = [os.path.relpath(s, common) if os.path.isabs(s) else s for s in sources]
    return [ModelRef(n, s) for n, s in zip(names, sources)]


@dataclass(frozen=True)
class Measure:
    """One measure: geodesic (``inv``/``mix``) or ``adaptive`` sharpness, worst or average case, or
    ``relative_flatness`` (Petzka et al.; it has no mode)."""

    kind: Kind
    mode: Mode = "worst"

    @property
    def name(self) -> str:
        """The engine's name for it (``SharpnessResult.measure``), also the table's column."""
        if self.kind == "relative_flatness":
            return "relative_flatness"
        if self.kind == "adaptive":
            return "adaptive_clean_worst" if self.mode == "worst" else "adaptive_average"
        return f"geodesic_{self.kind}_{self.mode}"


@dataclass(frozen=True)
class Settings:
    """Solver settings shared by all measures (each is part of every result's fingerprint)."""

    rho: float = 0.1
    steps: int = 20
    n_samples: int = 20
    seed: int = 0
    epsilon: float = 1e-6


@dataclass
class GapSpec:
    """Where each model's generalisation gap comes from: a file, or its error (or loss) on two splits.

    Attributes:
        file: CSV/TSV with columns ``model`` and ``gap``, or JSON ``{model: gap}``; models match by name or source.
        train_split, test_split: splits of the leaderboard's dataset; gap = test minus train.
        metric: ``"error"`` (paper's ViT setting: test error minus train error) or ``"loss"``.
        n_examples: examples per split (``None``: the whole split).
        batch_size: evaluation batch size.
    """

    file: Path | None = None
    train_split: str = "train"
    test_split: str = "test"
    metric: GapMetric = "error"
    n_examples: int | None = None
    batch_size: int = 256


def read_gap_file(path: Path) -> dict[str, float]:
    """``{model: gap}`` from a JSON mapping or a CSV/TSV with ``model`` and ``gap`` columns."""
    if not path.is_file():
        raise DataError(f"gap file {str(path)!r} does not exist.")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            data = json.loads(text)
            if not isinstance(data, dict):
                raise DataError(f"gap file {str(path)!r} must hold a JSON object {{model: gap}}.")
            return {str(k): float(v) for k, v in data.items()}
        rows = list(csv.DictReader(text.splitlines(), delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
        if not rows or not {"model", "gap"} <= set(rows[0]):
            raise DataError(f"gap file {str(path)!r} needs a header with columns 'model' and 'gap'.")
        return {row["model"]: float(row["gap"]) for row in rows}
    except UnicodeDecodeError:
        raise DataError(f"gap file {str(path)!r} is not UTF-8 text; save it as UTF-8.") from None
    except (TypeError, ValueError) as err:  # not JSON, or a gap that is not a number
        if isinstance(err, DataError):
            raise
        raise DataError(f"gap file {str(path)!r} cannot be read: {err}; every gap must be a number.") from None


# -------------------------------------------------------------------------------------------------------- running


@torch.no_grad()
def evaluate_split(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Example-weighted mean loss and (for classifiers) error rate over ``batches``."""
    n = loss_sum = wrong = 0.0
    for batch in batches:
        out = model(**batch)
        size = len(batch["labels"])
        n += size
        loss_sum += float(out.loss) * size
        wrong += float((out.logits.argmax(-1) != batch["labels"]).sum()) if batch["labels"].dim() == 1 else math.nan
    return {"loss": loss_sum / n, "error": wrong / n}


def _measure(
    measure: Measure, model: torch.nn.Module, batches: list, settings: Settings, smap: Any
) -> SharpnessResult:
    common = dict(rho=settings.rho, mode=measure.mode, steps=settings.steps, seed=settings.seed,
                  n_samples=settings.n_samples, progress=False)
    if measure.kind == "relative_flatness":
        return relative_flatness(model, batches, n_samples=settings.n_samples, seed=settings.seed)
    if measure.kind == "adaptive":
        return adaptive_sharpness(model, batches, **common)
    return geodesic_sharpness(
        model, batches, metric=measure.kind, epsilon=settings.epsilon, symmetry_map=smap, **common
    )


@dataclass
class Leaderboard:
    """Results of a leaderboard run: one row per model, and the Kendall taus of every predictor against the gap."""

    rows: list[dict[str, Any]]
    measures: list[str]
    gap_metric: str | None
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # model -> its stored measure records
    taus: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def predictors(self) -> list[str]:
        return [*self.measures, *TRIVIAL]


def run_leaderboard(
    models: list[ModelRef],
    data: DataSpec,
    measures: list[Measure],
    store: ResultStore,
    *,
    settings: Settings = Settings(),
    gap: GapSpec | None = None,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> Leaderboard:
    """Measure every model (skipping whatever ``store`` already holds) and assemble the ranked table.

    Each (model, measure) result, each model's trivial predictors and each model's split metrics is written to the
    store as soon as it exists, so killing the run loses at most the computation in flight. Results are keyed by the
    content of each model's files and of the data, so editing either recomputes them.
    """
    if not measures:
        raise ValueError("no measures given; pick some of 'inv', 'mix', 'adaptive'.")
    gap_table = read_gap_file(gap.file) if gap is not None and gap.file is not None else None
    data_key = data_identity(data, None if Path(data.dataset).exists() else load_split(data))
    rows, results = [], {}
    todo = len(models) * (len(measures) + 1 + (gap is not None and gap_table is None))
    bar = tqdm(total=todo, desc="leaderboard", unit="result", disable=not progress)
    not_converged = 0
    for ref in models:
        model = model_identity(ref.source)
        keys = {m.name: fingerprint(kind="measure", model=model, measure=m.name, data=data_key, **asdict(settings))
                for m in measures}
        keys["stats"] = fingerprint(kind="stats", model=model, data=data_key)
        if gap is not None and gap_table is None:
            splits = {k: v for k, v in asdict(gap).items() if k not in ("file", "metric")}  # both metrics are stored
            keys["splits"] = fingerprint(kind="splits", model=model, data=data_key, splits=splits)
        missing = [k for k, key in keys.items() if store.get(key) is None]
        bar.update(len(keys) - len(missing))
        if missing:
            with collected_convergence_notes() as notes:  # one summary line below, not a warning per result
                _compute_missing(ref, data, measures, settings, gap, store, keys, missing, bar, trust_remote_code)
            not_converged += len(notes)
        rows.append(_row(ref, measures, store, keys, gap, gap_table))
        results[ref.name] = [store.get(keys[m.name]) for m in measures]
    bar.close()
    if not_converged:
        logger.warning("%d of the results computed in this run are not converged at steps=%s (the worst-case value "
                       "was still rising; each stored record says so in 'converged'); raise --steps for tighter "
                       "values.", not_converged, settings.steps)
    board = Leaderboard(rows, [m.name for m in measures], gap.metric if gap is not None else None, results)
    if gap is not None:
        board.taus = kendall_taus(rows, board.predictors, seed=settings.seed)
    return board


def _compute_missing(
    ref: ModelRef, data: DataSpec, measures: list[Measure], settings: Settings, gap: GapSpec | None,
    store: ResultStore, keys: dict[str, str], missing: list[str], bar: tqdm, trust_remote_code: bool,
) -> None:
    bar.set_postfix(model=ref.name)
    model = load_model(ref.source, trust_remote_code=trust_remote_code)
    require_task(model)
    processor = load_processor(ref.source, model, trust_remote_code=trust_remote_code)
    batches = load_batches(model, processor, data)
    smap = None
    if any(m.kind in ("inv", "mix") and m.name in missing for m in measures):
        from .symmetry import map_symmetries

        smap = map_symmetries(model)
    for m in measures:
        if m.name not in missing:
            continue
        bar.set_postfix(model=ref.name, measure=m.name)
        start = time.perf_counter()
        res = _measure(m, model, batches, settings, smap)
        store.put({"key": keys[m.name], "kind": "measure", "model": ref.name, "source": ref.source,
                   "measure": res.measure, "value": res.value, "stderr": res.stderr, "converged": res.converged,
                   "convergence_gain": res.convergence_gain, "clean_loss": res.clean_loss,
                   "per_batch": res.per_batch, "config": res.config, "seconds": time.perf_counter() - start})
        bar.update()
    if "stats" in missing:
        clean = evaluate_split(model, batches)
        norm = float(torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
        store.put({"key": keys["stats"], "kind": "stats", "model": ref.name, "source": ref.source, "param_norm": norm,
                   "clean_loss": clean["loss"], "n_params": sum(p.numel() for p in model.parameters())})
        bar.update()
    if "splits" in missing:
        record = {"key": keys["splits"], "kind": "splits", "model": ref.name, "source": ref.source}
        for role, split in (("train", gap.train_split), ("test", gap.test_split)):
            spec = DataSpec(**{**asdict(data), "split": split, "n_examples": gap.n_examples,
                               "batch_size": gap.batch_size, "shuffle": gap.n_examples is not None})
            result = evaluate_split(model, load_batches(model, processor, spec))
            record.update({f"{role}_loss": result["loss"], f"{role}_error": result["error"]})
        store.put(record)
        bar.update()


def _row(
    ref: ModelRef, measures: list[Measure], store: ResultStore, keys: dict[str, str], gap: GapSpec | None,
    gap_table: dict[str, float] | None,
) -> dict[str, Any]:
    stats_record = store.get(keys["stats"])
    records = {m.name: store.get(keys[m.name]) for m in measures}
    row: dict[str, Any] = {"model": ref.name, **{name: r["value"] for name, r in records.items()},
                           **{f"{name}_stderr": r.get("stderr", math.nan) for name, r in records.items()},
                           "param_norm": stats_record["param_norm"], "clean_loss": stats_record["clean_loss"]}
    if gap is None:
        return row
    if gap_table is not None:
        value = gap_table.get(ref.name, gap_table.get(ref.source))
        if value is None:
            raise DataError(f"the gap file has no row for model {ref.name!r} (nor {ref.source!r}).")
        row["gap"] = value
    else:
        splits = store.get(keys["splits"])
        row.update({k: splits[k] for k in ("train_loss", "train_error", "test_loss", "test_error")})
        row["gap"] = splits[f"test_{gap.metric}"] - splits[f"train_{gap.metric}"]
    return row


# ---------------------------------------------------------------------------------------------------- statistics


def kendall_taus(
    rows: list[dict[str, Any]], predictors: list[str], *, n_resamples: int = 2000, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Kendall tau (scipy's tau-b; tau-a when there are no ties) of each predictor against ``gap``, with a
    percentile bootstrap 95 % interval over models (resampled in pairs). Below ``MIN_MODELS_FOR_CI`` models the
    resamples are too few and too often degenerate for an interval, so it is nan."""
    gap = np.array([r["gap"] for r in rows], dtype=float)
    out = {}
    for name in predictors:
        x = np.array([r[name] for r in rows], dtype=float)
        result = stats.kendalltau(x, gap)
        low = high = math.nan
        if len(rows) >= MIN_MODELS_FOR_CI:
            with warnings.catch_warnings():  # few models: constant resamples make tau undefined; the CI is then nan
                warnings.simplefilter("ignore", stats.DegenerateDataWarning)
                boot = stats.bootstrap(
                    (x, gap), lambda a, b: stats.kendalltau(a, b).statistic, paired=True, vectorized=False,
                    n_resamples=n_resamples, confidence_level=0.95, method="percentile",
                    rng=np.random.default_rng(seed),
                )
            low, high = float(boot.confidence_interval.low), float(boot.confidence_interval.high)
        out[name] = {"tau": float(result.statistic), "ci_low": low, "ci_high": high, "p_value": float(result.pvalue),
                     "n": len(rows)}
    return out


# ------------------------------------------------------------------------------------------------------- outputs


def ranked(board: Leaderboard) -> list[dict[str, Any]]:
    """Rows sorted by the first measure, flattest first, with a 1-based ``rank``."""
    key = board.measures[0]
    order = sorted(board.rows, key=lambda r: (math.isnan(r[key]), r[key], r["model"]))
    return [{"rank": i, **row} for i, row in enumerate(order, 1)]


def _fmt(value: Any, spec: str = ".4g") -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return format(value, spec) if isinstance(value, float) else str(value)


def table_markdown(board: Leaderboard) -> str:
    """The ranked table as Markdown."""
    table = ranked(board)
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(_fmt(row[c]) for c in cols) + " |" for row in table]
    return "\n".join(lines) + "\n"


def taus_markdown(board: Leaderboard) -> str:
    """Each predictor's Kendall tau against the gap, with its interval, as Markdown (empty without a gap)."""
    if not board.taus:
        return ""
    lines = [f"Kendall tau against the generalisation gap (test minus train {board.gap_metric}), "
             f"{len(board.rows)} models, bootstrap 95 % interval:", "",
             "| predictor | tau | 95 % CI | p-value |", "|---|---|---|---|"]
    for name, t in board.taus.items():
        ci = f"[{_fmt(t['ci_low'], '+.3f')}, {_fmt(t['ci_high'], '+.3f')}]"
        lines.append(f"| {name} | {_fmt(t['tau'], '+.3f')} | {ci} | {_fmt(t['p_value'], '.3g')} |")
    return "\n".join(lines) + "\n"


def markdown(board: Leaderboard) -> str:
    """The ranked table and, when there is a gap, the taus."""
    return "\n".join(filter(None, (table_markdown(board), taus_markdown(board))))


def write_csv(board: Leaderboard, path: Path) -> None:
    table = ranked(board)
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows({k: repr(v) if isinstance(v, float) else v for k, v in row.items()} for row in table)


def scatter_plot(board: Leaderboard, path: Path) -> None:
    """One panel per predictor, gap on the y axis, tau and its interval in the title (like the paper's Figs 3-5)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend switch, no GUI, safe in threads

    names = board.predictors
    fig = Figure(figsize=(3.2 * len(names), 3.2))
    axes = fig.subplots(1, len(names), squeeze=False, sharey=True)
    gap = [r["gap"] for r in board.rows]
    for ax, name in zip(axes[0], names):
        ax.scatter([r[name] for r in board.rows], gap, s=18, color="#c44e52" if name in TRIVIAL else "#4c72b0")
        t = board.taus[name]
        ci = f"[{_fmt(t['ci_low'], '+.2f')}, {_fmt(t['ci_high'], '+.2f')}]"
        ax.set_title(f"{name}\n\u03c4 = {_fmt(t['tau'], '+.2f')} {ci}", fontsize=9)
        ax.set_xlabel(name, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel(f"generalisation gap ({board.gap_metric})", fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)


def write_outputs(board: Leaderboard, out_dir: Path) -> dict[str, Path]:
    """``leaderboard.md``, ``leaderboard.csv`` and, with a gap, ``taus.json`` and ``scatter.png``, each replaced
    durably (a failed write leaves the previous file intact)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "leaderboard.md", "csv": out_dir / "leaderboard.csv"}
    write_text(paths["markdown"], markdown(board))
    write_csv(board, paths["csv"])
    if board.taus:
        paths["taus"] = out_dir / "taus.json"
        write_json(paths["taus"], {"gap_metric": board.gap_metric, "taus": board.taus})
        paths["plot"] = out_dir / "scatter.png"
        scatter_plot(board, paths["plot"])
    return paths
