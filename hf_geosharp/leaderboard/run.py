"""Running a leaderboard: measure every model on the same batches, with its trivial predictors and (optionally) its
split metrics, storing each number the moment it exists so that a rerun computes only what is missing."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..api import SharpnessResult, collected_convergence_notes
from ..data import DataError, DataSpec, load_batches, load_processor, load_split, require_task
from ..engine.progress import Stages, bar_disabled, lines_wanted
from ..measures import MEASURES, Settings
from ..pipeline import Memo, ModelSource, Request, load, prepare
from .inputs import Column, GapSpec, ModelRef, read_gap_file
from .statistics import kendall_taus, tau_differences
from .store import ResultStore, data_identity, fingerprint, model_identity

logger = logging.getLogger(__name__)

class ModelError(DataError):
    """One model of the list cannot be measured as it is (NaN weights, a buffer without data, ...): the message names
    the model and the fix; a rerun of the same list would fail the same way."""


class ModelFailed(RuntimeError):
    """Measuring one model failed for a reason that may pass (out of memory, a killed worker): names the model."""


#: What a model that cannot be measured as it is raises (checks before the work, a NaN loss): not worth a rerun.
MODEL_FAULTS = (ValueError, TypeError, FloatingPointError, IndexError)


TRIVIAL = ("param_norm", "clean_loss")  # the baselines every measure must beat
#: ``{column name: (measure key, the settings it runs with)}``, in column order.
Plan = dict[str, tuple[str, Settings]]


@torch.no_grad()
def evaluate_split(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Example-weighted mean loss and (for classifiers) error rate over ``batches``.

    Args:
        model: a model with a loss head.
        batches: the split's batches, labels included.

    Returns:
        ``{"loss": mean loss, "error": error rate}`` (error NaN when the labels are not class ids).
    """
    n = loss_sum = wrong = 0.0
    for batch in batches:
        out = model(**batch)
        size = len(batch["labels"])
        n += size
        loss_sum += float(out.loss) * size
        wrong += float((out.logits.argmax(-1) != batch["labels"]).sum()) if batch["labels"].dim() == 1 else math.nan
    return {"loss": loss_sum / n, "error": wrong / n}


def plan(columns: list[Column], settings: Settings) -> Plan:
    """Each column's name and what it runs; a column asked twice under one name (relative flatness, which has no
    mode, in both modes) once."""
    runs: Plan = {}
    for column in columns:
        runs.setdefault(column.name(settings), (column.key, column.settings(settings)))
    return runs


def fingerprint_settings(settings: Settings) -> dict[str, Any]:
    """The settings that key a stored result besides its column's name, which already says the mode and the
    adaptive solver."""
    return {k: v for k, v in settings.as_dict().items() if k not in ("mode", "adaptive_variant")}


@dataclass
class Leaderboard:
    """Results of a leaderboard run: one row per model, and the Kendall taus of every predictor against the gap."""

    rows: list[dict[str, Any]]
    measures: list[str]
    gap_metric: str | None
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # model -> its stored measure records
    taus: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Each measure's tau minus the parameter norm's, with a paired interval: does it rank better than the norm?
    versus_param_norm: dict[str, dict[str, float]] = field(default_factory=dict)
    #: The radius measures' taus and certified counts across radii (:func:`rho_sweep`), when one was asked for.
    sweep: dict[str, Any] | None = None

    @property
    def predictors(self) -> list[str]:
        """The table's predictors: every measure's column, then the trivial ones."""
        return [*self.measures, *TRIVIAL]

    def certified(self, measure: str) -> tuple[int, int] | None:
        """How many of ``measure``'s results are certified converged, of how many (None for a trivial predictor).

        Args:
            measure: a column's name.

        Returns:
            (certified, measured) counts, or ``None`` for a trivial predictor.
        """
        if measure not in self.measures:
            return None
        i = self.measures.index(measure)
        flags = [records[i].get("converged") for records in self.results.values() if records[i] is not None]
        return sum(flag is not False for flag in flags), len(flags)

    def not_converged(self) -> list[tuple[str, str]]:
        """(model, measure) of every worst-case result that is not certified converged, computed or cached.

        Returns:
            (model, measure) pairs.
        """
        return [(model, record["measure"]) for model, records in self.results.items() for record in records
                if record is not None and record.get("converged") is False]


def run_leaderboard(
    models: list[ModelRef],
    data: DataSpec,
    columns: list[Column],
    store: ResultStore,
    *,
    settings: Settings | None = None,
    gap: GapSpec | None = None,
    progress: bool = True,
    trust_remote_code: bool = False,
    desc: str = "leaderboard",
    warn_unconverged: bool = True,
    statistics: bool = True,
) -> Leaderboard:
    """Measure every model (skipping whatever ``store`` already holds) and assemble the ranked table.

    Each (model, measure) result, each model's trivial predictors and each model's split metrics is written to the
    store as soon as it exists, so killing the run loses at most the computation in flight. Results are keyed by the
    content of each model's files and of the data, so editing either recomputes them. ``desc`` names the progress
    bar; ``warn_unconverged=False`` leaves out the warning about uncertified results, ``statistics=False`` the taus.

    Args:
        models: the models (:func:`resolve_models`).
        data: the data every model is measured on.
        columns: the measures, one column each.
        store: where results are kept and looked up.
        settings: the shared settings (default: the declared ones).
        gap: how each model's generalisation gap is obtained (``None``: no taus).
        progress: show progress bars.
        trust_remote_code: allow the models' custom code to run.
        desc: the progress bar's name.
        warn_unconverged: warn about uncertified worst-case results.
        statistics: compute the taus against the gap.

    Returns:
        The :class:`Leaderboard`: rows, columns and, with a gap, the taus.
    """
    if not columns:
        raise ValueError("no measures given; pick some of 'inv', 'mix', 'adaptive'.")
    settings = Settings() if settings is None else settings
    runs = plan(columns, settings)
    gap_table = read_gap_file(gap.file) if gap is not None and gap.file is not None else None
    data_key = data_identity(data, None if Path(data.dataset).exists() else load_split(data))
    rows, results = [], {}
    todo = len(models) * (len(runs) + 1 + (gap is not None and gap_table is None))
    bar = tqdm(total=todo, desc=desc, unit="result", disable=bar_disabled(progress))
    job = Stages(desc if desc == "leaderboard" else f"leaderboard at {desc}", todo, "result", progress)
    for ref in models:
        model = model_identity(ref.source)
        keys = {name: fingerprint(kind="measure", model=model, measure=name, data=data_key,
                                  **fingerprint_settings(settings)) for name in runs}
        keys["stats"] = fingerprint(kind="stats", model=model, data=data_key)
        if gap is not None and gap_table is None:
            splits = {k: v for k, v in asdict(gap).items() if k not in ("file", "metric")}  # both metrics are stored
            keys["splits"] = fingerprint(kind="splits", model=model, data=data_key, splits=splits)
        missing = [k for k, key in keys.items() if store.get(key) is None]
        bar.update(len(keys) - len(missing))
        job.update(len(keys) - len(missing))
        if missing:
            with collected_convergence_notes(), _naming(ref):  # one summary line below, not a warning per result
                _compute_missing(ref, data, runs, gap, store, keys, missing, bar, job, progress, trust_remote_code)
        rows.append(_row(ref, list(runs), store, keys, gap, gap_table))
        results[ref.name] = [store.get(keys[name]) for name in runs]
    bar.close()
    board = Leaderboard(rows, list(runs), gap.metric if gap is not None else None, results)
    if warn_unconverged and (unconverged := board.not_converged()):
        logger.warning("%d of the worst-case results are not converged at steps=%s (not certified as the maximum; "
                       "each stored record says so in 'converged' and why in 'convergence_note'); %s.",
                       len(unconverged), settings.steps, convergence_fix(settings.steps))
    if gap is not None and statistics:
        board.taus = kendall_taus(rows, board.predictors, seed=settings.seed)
        board.versus_param_norm = tau_differences(rows, board.measures, "param_norm", seed=settings.seed)
    return board


#: The families whose value depends on the radius: a rho sweep measures these columns again at each radius.
RADIUS_FAMILIES = ("geodesic", "adaptive")


def radius_columns(columns: list[Column]) -> list[Column]:
    """The columns of ``columns`` whose measure has a radius (geodesic and adaptive sharpness)."""
    return [c for c in columns if MEASURES[c.key].family in RADIUS_FAMILIES]


def rho_sweep(
    models: list[ModelRef],
    data: DataSpec,
    columns: list[Column],
    store: ResultStore,
    rhos: list[float],
    *,
    settings: Settings,
    gap: GapSpec,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Each radius measure's Kendall tau against the gap (with its interval) and its certified count at every radius
    of ``rhos`` and at ``settings.rho``, each radius a leaderboard of its own through ``store`` (a rerun measures
    only what is missing; the leaderboard at ``settings.rho`` is usually stored already).

    Returns:
        Plain data (JSON): ``rhos`` (sorted), ``rho`` (the leaderboard's), ``gap_metric``, ``n_models``,
        ``n_examples`` (measured on), ``settings`` (the shared settings but the radius) and per column name
        ``measures[name]``: its registry ``key`` and, one entry per radius, ``tau``, ``ci_low``, ``ci_high``,
        ``p_value``, ``certified`` and ``total``.
    """
    columns = radius_columns(columns)
    if not columns:
        raise ValueError("a rho sweep needs a measure with a radius (inv, mix or adaptive).")
    grid = sorted({float(r) for r in rhos} | {float(settings.rho)})
    out: dict[str, Any] = {"rhos": grid, "rho": float(settings.rho), "gap_metric": gap.metric, "n_models": len(models),
                           "n_examples": data.n_examples,
                           "settings": {k: v for k, v in fingerprint_settings(settings).items() if k != "rho"},
                           "measures": {}}
    for rho in grid:
        board = run_leaderboard(models, data, columns, store, settings=dataclasses.replace(settings, rho=rho), gap=gap,
                                progress=progress, trust_remote_code=trust_remote_code, desc=f"rho {rho:g}",
                                warn_unconverged=False,  # the figure shows the certified fraction per radius
                                statistics=False)
        # the measures' taus only: the trivial predictors do not depend on the radius (bootstraps are half the cost)
        taus = kendall_taus(board.rows, board.measures, seed=settings.seed)
        for name in board.measures:
            entry = out["measures"].setdefault(name, {"key": plan(columns, settings)[name][0], "tau": [],
                                                       "ci_low": [], "ci_high": [], "p_value": [], "certified": [],
                                                       "total": []})
            certified, total = board.certified(name)
            for field_name in ("tau", "ci_low", "ci_high", "p_value"):
                entry[field_name].append(taus[name][field_name])
            entry["certified"].append(certified)
            entry["total"].append(total)
    return out


@contextlib.contextmanager
def _naming(ref: ModelRef) -> Iterator[None]:
    """Errors while one model is measured name that model: :class:`ModelError` for what a rerun would meet again,
    :class:`ModelFailed` for the rest (Ctrl-C passes through)."""
    name = repr(ref.name) if ref.name == ref.source else f"{ref.name!r} ({ref.source})"
    try:
        yield
    except DataError as err:
        if str(err).startswith(f"model {name}"):
            raise
        raise ModelError(f"model {name}: {err}") from err
    except MODEL_FAULTS as err:
        raise ModelError(f"model {name} cannot be measured as it is: {err} Fix that model or remove it from the "
                         "model list; a rerun with it unchanged fails the same way.") from err
    except Exception as err:
        raise ModelFailed(f"model {name}: {type(err).__name__}: {err}") from err


def convergence_fix(steps: int | str) -> str:
    """What to change when some worst-case results are not certified at ``steps``, in the reader's words (options
    under ``geosharp``, arguments in Python).

    Args:
        steps: the step setting the results were measured with.

    Returns:
        The sentence that says what to change.
    """
    from ..engine.result import setting

    return (f"{setting('steps', 'auto')} continues until certified or says why not" if steps != "auto"
            else f"a lower {setting('rho')} is certified more easily")


def _compute_missing(
    ref: ModelRef, data: DataSpec, runs: Plan, gap: GapSpec | None, store: ResultStore, keys: dict[str, str],
    missing: list[str], bar: tqdm, job: Stages, progress: bool, trust_remote_code: bool,
) -> None:
    """Compute and store what ``store`` lacks of model ``ref``; a log gets a line as each result starts and, where
    no bar shows, the engine's lines within each measure (on a terminal the leaderboard's bar alone)."""
    bar.set_postfix(model=ref.name)
    model = load(ModelSource(ref.source, trust_remote_code))
    require_task(model)
    processor = load_processor(ref.source, model, trust_remote_code=trust_remote_code)
    batches = load_batches(model, processor, data)
    # the note from one map (none when only non-geodesic columns are missing); each column maps for its own run
    measured = [key for name, (key, _) in runs.items() if name in missing]
    prepared = prepare(Request(model, batches, measured, name=ref.name, progress=lines_wanted(progress)))
    if note := prepared.note:
        logger.warning(note)
    memo = Memo(store)

    def measure_record(key: str, settings: Settings) -> dict[str, Any]:
        start = time.perf_counter()
        res: SharpnessResult = prepared.measure_one(key, settings)
        return {"kind": "measure", "model": ref.name, "source": ref.source,
                "measure": res.measure, "value": res.value, "stderr": res.stderr, "converged": res.converged,
                "stationarity_gap": res.stationarity_gap, "convergence_note": res.convergence_note,
                "clean_loss": res.clean_loss, "per_batch": res.per_batch, "config": res.config,
                "breakdown": res.to_dict().get("breakdown"), "seconds": time.perf_counter() - start}

    def stats_record() -> dict[str, Any]:
        clean = evaluate_split(model, batches)
        norm = float(torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
        return {"kind": "stats", "model": ref.name, "source": ref.source, "param_norm": norm,
                "clean_loss": clean["loss"], "n_params": sum(p.numel() for p in model.parameters())}

    def splits_record() -> dict[str, Any]:
        record: dict[str, Any] = {"kind": "splits", "model": ref.name, "source": ref.source}
        for role, split in (("train", gap.train_split), ("test", gap.test_split)):
            spec = DataSpec(**{**asdict(data), "split": split, "n_examples": gap.n_examples,
                               "batch_size": gap.batch_size, "shuffle": gap.n_examples is not None})
            result = evaluate_split(model, load_batches(model, processor, spec))
            record.update({f"{role}_loss": result["loss"], f"{role}_error": result["error"]})
        return record

    for name, (key, settings) in runs.items():
        if name not in missing:
            continue
        bar.set_postfix(model=ref.name, measure=name)
        job.begin(f"{ref.name}: {name}")
        memo(keys[name], lambda key=key, settings=settings: measure_record(key, settings))
        bar.update()
        job.update()
    for name, compute in (("stats", stats_record), ("splits", splits_record)):
        if name in missing:
            job.begin(f"{ref.name}: {'parameter norm and clean loss' if name == 'stats' else 'split errors'}")
            memo(keys[name], compute)
            bar.update()
            job.update()


def _row(
    ref: ModelRef, names: list[str], store: ResultStore, keys: dict[str, str], gap: GapSpec | None,
    gap_table: dict[str, float] | None,
) -> dict[str, Any]:
    stats_record = store.get(keys["stats"])
    records = {name: store.get(keys[name]) for name in names}
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
