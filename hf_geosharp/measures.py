"""The registry of measures: which measures exist, their public names, their shared settings, and how to run them.

Every face (``geosharp run``, ``geosharp leaderboard`` and ``geosharp demo``, the evaluate module, model cards, hide &
seek, the Space, the Trainer callback) asks this module what "geodesic sharpness plus its baselines" means, so that
the names, the defaults and the order of the measures are written once. Adding a measure is one :class:`MeasureSpec`
in :data:`MEASURES` (and, for a new family, its branch in :func:`run_measure`); every face picks it up.

Names, one meaning each in every face: a measure's **key** is its public name (``geodesic_sharpness_inv``: the
evaluate output key, the model-card metric type, the results-JSON column; ``<key>_stderr`` is its error bar), its
``short`` form what command lines accept (``inv``); its **engine name** is what the engine calls one run of it, which
also says the mode and the solver (``geodesic_inv_worst``: ``SharpnessResult.measure``, the leaderboard's columns,
:meth:`MeasureSpec.engine_name`; :func:`key_of_engine_name` goes back). A measure's **settings** are
:class:`Settings`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .api import (
    SharpnessResult,
    adaptive_sharpness,
    geodesic_sharpness,
    no_symmetry_note,
    symmetry_note_given,
    symmetry_noted,
)
from .engine.defaults import ADAPTIVE_VARIANT, BALL, COMPILE, EPSILON, MODE, N_SAMPLES, RHO, SEED, STEPS
from .engine.hessian import hessian_top_eigenvalue, hessian_trace
from .engine.relative_flatness import relative_flatness
from .engine.settings import MODES, VARIANTS, Mode, Steps, Variant, measure_name
from .engine.space.perturbation_space import BALLS, Ball

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeasureSpec:
    """One measure of the bundle.

    Attributes:
        key: public name (evaluate key, card metric type, table column).
        title: what a reader sees (``"Geodesic sharpness (inv)"``).
        family: ``"geodesic"`` (invariant under the attention symmetries) or a baseline's family (``"adaptive"``,
            ``"relative_flatness"``, the Hessian's ``"hessian_top_eigenvalue"`` and ``"hessian_trace"``).
        metric: the geodesic metric (``"inv"``/``"mix"``), else ``None``.
        short: the short form command lines and ``parse_measures`` accept (``"inv"``), else ``None``.
    """

    key: str
    title: str
    family: str
    metric: str | None = None
    short: str | None = None

    @property
    def invariant(self) -> bool:
        """Whether the number is invariant under the model's symmetry group (the point of geodesic sharpness)."""
        return self.family == "geodesic"

    def engine_name(self, settings: Settings) -> str:
        """The engine's name of this measure run with ``settings`` (``SharpnessResult.measure``): it says the mode
        and the solver, so a leaderboard column and its stored results are named by it."""
        return measure_name(self.family, settings.mode, metric=self.metric, variant=settings.adaptive_variant)


MEASURES: dict[str, MeasureSpec] = {
    spec.key: spec
    for spec in (
        MeasureSpec("geodesic_sharpness_inv", "Geodesic sharpness (inv)", "geodesic", "inv", short="inv"),
        MeasureSpec("geodesic_sharpness_mix", "Geodesic sharpness (mix)", "geodesic", "mix", short="mix"),
        MeasureSpec("adaptive_sharpness", "Adaptive sharpness", "adaptive", short="adaptive"),
        MeasureSpec("relative_flatness", "Relative flatness (Petzka et al.)", "relative_flatness", short="relative"),
        MeasureSpec("hessian_top_eigenvalue", "Hessian top eigenvalue", "hessian_top_eigenvalue", short="eigenvalue"),
        MeasureSpec("hessian_trace", "Hessian trace (Hutchinson)", "hessian_trace", short="trace"),
    )
}
#: What a face computes when the user names no measure: both geodesic metrics and the adaptive baseline.
DEFAULT_MEASURES: tuple[str, ...] = ("geodesic_sharpness_inv", "geodesic_sharpness_mix", "adaptive_sharpness")
#: What a leaderboard (and the demo) compares when the user names no measure: the default bundle and relative
#: flatness. The Hessian's measures cost tens of Hessian-vector products per batch: named with ``--measures``.
BOARD_MEASURES: tuple[str, ...] = (*DEFAULT_MEASURES, "relative_flatness")


def _declared(default: Any, meaning: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field of :class:`Settings`: its default (from :mod:`hf_geosharp.engine.defaults`), what it means (the one
    text every face shows for it, e.g. ``geosharp`` option help) and, for a choice, the values allowed."""
    return dataclasses.field(default=default, metadata={"help": meaning, "choices": choices})


@dataclass(frozen=True)
class Settings:
    """The settings every measure of one run shares: the one declaration of their names, defaults and meanings
    (each field's ``help``, :func:`setting_help`). The command lines' options, the evaluate module's arguments and
    the leaderboard's keys are derived from it; the public functions' keywords and the engine's
    :class:`~hf_geosharp.engine.settings.RunSettings` are checked against it (``tests/test_settings.py``). The
    engine checks the values when a measure runs.

    Attributes:
        rho: radius of the perturbation ball.
        mode: ``"worst"`` or ``"average"``.
        steps: solver iterations per batch (worst case), or ``"auto"`` (continue until certified, docs/method.md).
        n_samples: random directions per batch (average case).
        seed: seeds every random draw (per batch, independent of the process that solves it).
        epsilon: relaxation of the geodesic metric's Gram matrices.
        ball: the geodesic ball's radius convention, ``"calibrated"`` or ``"paper"`` (docs/method.md, "Radius
            convention").
        adaptive_variant: the adaptive baseline's solver (``"clean"``; ``"as23"`` reproduces the reference code,
            which stalls below the maximum).
        compile: how the worst case's solver step runs (:mod:`hf_geosharp.engine.capture`); it changes no number
            beyond rounding, so :meth:`as_dict` leaves it out.
    """

    rho: float = _declared(RHO, "perturbation radius")
    mode: Mode = _declared(MODE, "worst or average case")
    steps: Steps = _declared(STEPS, "solver steps per batch (worst case), or auto: until certified")
    n_samples: int = _declared(N_SAMPLES, "random directions per batch (average case)")
    seed: int = _declared(SEED, "seeds the example shuffle and every random draw")
    epsilon: float = _declared(EPSILON, "regulariser of the geodesic metric's Gram matrices")
    ball: Ball = _declared(BALL, "radius convention of the geodesic ball: calibrated (rho comparable with adaptive's) "
                                 "or paper (the paper's unweighted metrics)", choices=BALLS)
    adaptive_variant: Variant = _declared(ADAPTIVE_VARIANT, "the adaptive baseline's solver: clean or as23")
    compile: str = _declared(COMPILE, "how the worst case's step runs: off (eager), default (torch.compile), "
                                      "reduce-overhead (CUDA graphs, CUDA only) or a torch.compile backend")

    def as_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (results files, cache keys). ``ball`` is left out when it is the paper's:
        settings recorded before the convention existed hold none and were the paper's, so they keep their keys,
        and a record without ``ball`` reads as the paper's."""
        out = dataclasses.asdict(self)
        del out["compile"]  # how, not what: results and cache keys do not depend on it
        if out["ball"] == "paper":
            del out["ball"]
        return out


def setting_help(name: str) -> str:
    """What the shared setting ``name`` means, as every face says it (a :class:`Settings` field's ``help``).

    Args:
        name: a field of :class:`Settings`.

    Returns:
        Its one-line meaning.
    """
    return next(f.metadata["help"] for f in dataclasses.fields(Settings) if f.name == name)


def spec(key: str) -> MeasureSpec:
    """The :class:`MeasureSpec` of ``key``, or a ``ValueError`` that lists the known keys."""
    try:
        return MEASURES[key]
    except KeyError:
        raise ValueError(f"unknown measure {key!r}; use one of {', '.join(MEASURES)}.") from None


def key_of_engine_name(name: str) -> str | None:
    """The registry key of the engine's name of a result (``SharpnessResult.measure``, e.g. ``geodesic_inv_average``
    -> ``geodesic_sharpness_inv``), or ``None`` for a name no measure of the registry gives."""
    every = [Settings(mode=mode, adaptive_variant=variant) for mode in MODES for variant in VARIANTS]
    return next((key for key, measure in MEASURES.items() for settings in every
                 if measure.engine_name(settings) == name), None)


def parse_measures(text: str | Iterable[str] | None) -> list[str]:
    """Measure keys from a comma-separated string or a list; the short forms (``inv``, ``mix``, ``adaptive``,
    ``relative``, ``eigenvalue``, ``trace``) accepted."""
    if text is None:
        return list(DEFAULT_MEASURES)
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t and t.strip()]
    short = {s.short: s.key for s in MEASURES.values() if s.short}
    keys = [short.get(i, i) for i in items]
    for key in keys:
        spec(key)
    if not keys:
        raise ValueError(f"no measure given; use some of {', '.join(MEASURES)}.")
    return list(dict.fromkeys(keys))


def _engine_kwargs(settings: Settings) -> dict[str, Any]:
    """The settings every sharpness function of the engine takes."""
    return dict(rho=settings.rho, mode=settings.mode, steps=settings.steps, n_samples=settings.n_samples,
                seed=settings.seed, compile=settings.compile)


def run_measure(
    key: str, model: Any, batches: list, settings: Settings = Settings(), **options: Any
) -> SharpnessResult:
    """Run one measure of the bundle with ``settings``; ``options`` go to the engine (``symmetry_map``,
    ``accelerator``, ``progress``, ``loss_fn``; a ``symmetry_map`` is dropped for measures that do not use one).

    Relative flatness depends on none of the settings: it is the exact trace (``relative_flatness``). The Hessian's
    top eigenvalue takes the ``seed`` (its Lanczos runs' starts), its trace the ``seed`` and ``n_samples``
    (Hutchinson samples per batch); both run a transformers model with eager attention (:mod:`.engine.hessian`). The
    note of a model with nothing to quotient (:func:`no_symmetry_note`) is the caller's to give, once:
    :func:`run_measures` and the leaderboard say it."""
    measure = spec(key)
    kwargs = _engine_kwargs(settings)
    if measure.family == "relative_flatness":
        kept = {k: options[k] for k in ("loss_fn",) if k in options}
        return relative_flatness(model, batches, **kept)  # the exact trace
    if measure.family in ("hessian_top_eigenvalue", "hessian_trace"):
        kept = {k: options[k] for k in ("loss_fn", "progress") if k in options}
        if measure.family == "hessian_trace":
            return hessian_trace(model, batches, n_samples=settings.n_samples, seed=settings.seed, **kept)
        return hessian_top_eigenvalue(model, batches, seed=settings.seed, **kept)
    if measure.family == "geodesic":
        with symmetry_note_given():
            return geodesic_sharpness(model, batches, metric=measure.metric, epsilon=settings.epsilon,
                                      ball=settings.ball, **kwargs, **options)
    options.pop("symmetry_map", None)
    return adaptive_sharpness(model, batches, variant=settings.adaptive_variant, **kwargs, **options)


def run_measures(
    keys: Iterable[str],
    model: Any,
    batches: list,
    settings: Settings = Settings(),
    *,
    on_result: Callable[[str, SharpnessResult, float], None] | None = None,
    **options: Any,
) -> dict[str, SharpnessResult]:
    """Run several measures on the same batches, in the order given.

    ``on_result(key, result, seconds)`` is called as each one finishes (progress, stores). A ``symmetry_map`` in
    ``options`` is given to every geodesic measure; without one each maps the model for its own run and frees the map
    before its solver starts, so no map is held through a solve. A model with nothing to quotient gets
    :func:`no_symmetry_note` once, as a log warning (not inside :func:`symmetry_note_given`)."""
    import time

    keys = list(keys)
    if any(spec(k).family == "geodesic" for k in keys) and not symmetry_noted():
        from .symmetry import map_symmetries

        given = options.get("symmetry_map")
        note = no_symmetry_note(map_symmetries(model) if given is None else given)  # a map made here is dropped
        if note:
            logger.warning(note)
    out: dict[str, SharpnessResult] = {}
    for key in keys:
        start = time.perf_counter()
        out[key] = run_measure(key, model, batches, settings, **dict(options))
        if on_result is not None:
            on_result(key, out[key], time.perf_counter() - start)
    return out


def result_fields(key: str, result: SharpnessResult) -> dict[str, Any]:
    """The flat public fields of one result: ``key``, ``key_stderr`` and ``key_per_batch``."""
    stderr = getattr(result, "stderr", math.nan)
    return {key: result.value, f"{key}_stderr": stderr, f"{key}_per_batch": list(result.per_batch)}
