"""One measurement, typed: a :class:`Request` in, results out, the same way for every face.

The pipeline owns what lies between a face's inputs and the registry's measures: loading a model (:func:`load`), the
symmetry map (made on the unsharded model for the report, the note and the sharding; without a map of the caller's,
each geodesic measure maps the model again for its own run, so no map, 8 bytes per paired coordinate, is held through
a solve), FSDP2 sharding (``fsdp=True``: the model is sharded over the ranks of a distributed launch with pair rows
kept whole), how the batches are shared across ranks (data parallel through ``accelerate``; sharded, every rank
solves every batch, passing its rows of each when ``share_rows`` allows), the measures' runs and the time estimate.
Faces parse their inputs into a :class:`Request` and format what comes back.

    prepared = prepare(Request(model, batches, measures=("geodesic_sharpness_inv",)))  # maps, shards
    results = prepared.measure()                                                       # {key: SharpnessResult}
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..api import SharpnessResult, no_symmetry_note, symmetry_note_given, symmetry_noted
from ..data import DataError, launch_accelerator, load_model, require_model
from ..engine.placement.sharding import attention_placement, is_sharded, shard_model
from ..engine.solvers.apgd import AUTO_BLOCK
from ..measures import DEFAULT_MEASURES, Settings, parse_measures, run_measure, run_measures, spec
from ..symmetry import SymmetryMap, map_symmetries

logger = logging.getLogger(__name__)

#: ``on_result(key, result, seconds)``: called as each measure finishes.
OnResult = Callable[[str, SharpnessResult, float], None]


# ---------------------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from and how it is loaded.

    Attributes:
        model_id: a saved model folder or a Hub id, with its task head.
        trust_remote_code: run the model's own code from the Hub.
        new_head_labels: attach a NEW linear classification head with this many classes (an encoder without a
            head, e.g. a sentence-transformers BertModel), initialised from ``seed``; ``None``: as saved.
        seed: seeds the new head's initialisation.
    """

    model_id: str
    trust_remote_code: bool = False
    new_head_labels: int | None = None
    seed: int = 0


def load(source: ModelSource) -> nn.Module:
    """The model of ``source``, in eval mode (on the CPU, as loaded).

    Args:
        source: what to load.

    Returns:
        The model; with ``new_head_labels``, the encoder with a new seeded head (transformers' initialisation).
    """
    if source.new_head_labels is None:
        return load_model(source.model_id, trust_remote_code=source.trust_remote_code)
    from transformers import AutoModelForSequenceClassification

    require_model(source.model_id)  # at once, not after the Hub's retries

    with torch.random.fork_rng(devices=[]):  # the head's initialisation is transformers', from this seed
        torch.manual_seed(source.seed)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                source.model_id, num_labels=source.new_head_labels, trust_remote_code=source.trust_remote_code
            )
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            raise DataError(
                f"could not attach a {source.new_head_labels}-class head to {source.model_id!r}: {err}. --head needs "
                "an encoder that AutoModelForSequenceClassification knows (BERT, RoBERTa, MiniLM, ...)."
            ) from None
    return model.eval()


def symmetry_map(model: nn.Module, **options: Any) -> SymmetryMap:
    """The model's symmetry map (:func:`hf_geosharp.map_symmetries`; ``options``: ``strict``, ``params``): the one
    call of the mapper on the faces' side.

    Args:
        model: the model.
        **options: ``strict`` and ``params``, as :func:`hf_geosharp.map_symmetries` takes them.

    Returns:
        The model's :class:`~hf_geosharp.symmetry.SymmetryMap`.
    """
    return map_symmetries(model, **options)


# --------------------------------------------------------------------------------------------------------- request


@dataclass(frozen=True)
class Request:
    """What to measure, on what, with which settings, and how the processes share the work.

    Attributes:
        model: the model to measure (never modified; under ``fsdp`` sharded in place, as the caller asked).
        batches: what ``model(**batch)`` (or ``loss_fn``) turns into the loss; every rank passes the same ones.
        measures: registry keys or short forms (``inv``, ``mix``, ``adaptive``, ...), in the order run.
        settings: the settings every measure shares.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` instead of the model's own loss.
        fsdp: shard an unsharded ``model`` with FSDP2 over the ranks of the distributed launch (after mapping it);
            a model already sharded is measured sharded either way.
        share_rows: sharded, each rank passes the engine its rows of every batch (compute shared too), where the
            loss is a mean over examples (``task="classification"``, no ``loss_fn``) and every batch has a row for
            every rank; otherwise every rank passes the whole batches.
        task: the model's task (:func:`hf_geosharp.data.task_of`), for ``share_rows``.
        accelerator: data parallel: an ``accelerate.Accelerator`` sharing the batches out.
        share_batches: under a launch of several processes, share the batches out through ``accelerator`` or, when
            none is given, the launcher's (the model unsharded; a sharded model is solved by all ranks together).
            Without it each process measures every batch itself (a Trainer's ranks, hide & seek).
        progress: show progress bars.
        profile_points: the loss along each worst direction at that many points (0: none).
        symmetry_map: the map, when the caller has it; default: made here when a geodesic measure (or ``fsdp``)
            needs it, or ``map_always``.
        map_always: map the model even when no measure uses the map (a face that reports it).
        conditioning: the map's report includes each pair's conditioning (``SymmetryMap.summary(model)``).
        name: what the no-symmetry note calls the model.
    """

    model: nn.Module
    batches: Sequence[Any]
    measures: Sequence[str] = DEFAULT_MEASURES
    settings: Settings = field(default_factory=Settings)
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    fsdp: bool = False
    share_rows: bool = False
    task: str | None = None
    accelerator: Any = None
    share_batches: bool = False
    progress: bool = False
    profile_points: int = 0
    symmetry_map: SymmetryMap | None = None
    map_always: bool = False
    conditioning: bool = False
    name: str = "the model"

    @property
    def keys(self) -> list[str]:
        """The registry keys asked for, in order (short forms resolved; a ``ValueError`` names an unknown one)."""
        return parse_measures(list(self.measures)) if self.measures else []

    @property
    def geodesic(self) -> bool:
        """Whether a measure of the request runs on the symmetry map."""
        return any(spec(k).family == "geodesic" for k in self.keys)


@dataclass
class Prepared:
    """A request made ready: mapped, sharded where asked, its batches shared across the ranks.

    Attributes:
        request: what was asked.
        symmetry_map: the map every measure is given: the caller's, or under sharding the one made on the unsharded
            model; otherwise ``None`` and each geodesic measure maps the model for its own run, so no map is held
            while a solver runs (its index maps are 2 bytes per parameter of BERT-base).
        symmetry_report: the map's report (``SymmetryMap.summary()``) where a measure or ``map_always`` made or
            gave one; ``None`` otherwise.
        note: the note of a model with nothing to quotient (:func:`hf_geosharp.api.no_symmetry_note`), where a
            geodesic measure was asked for; ``None`` otherwise.
        sharded: whether the model is measured FSDP2-sharded.
        world: processes of the launch (1 without one).
        batches: what this rank passes the engine.
        accelerator: the data-parallel accelerator, or ``None``.
    """

    request: Request
    symmetry_map: SymmetryMap | None
    symmetry_report: dict[str, Any] | None
    note: str | None
    sharded: bool
    world: int
    batches: list
    accelerator: Any

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = dict(symmetry_map=self.symmetry_map, progress=self.request.progress)
        if self.request.loss_fn is not None:
            options["loss_fn"] = self.request.loss_fn
        if self.accelerator is not None:
            options["accelerator"] = self.accelerator
        return options

    def measure(self, on_result: OnResult | None = None) -> dict[str, SharpnessResult]:
        """Run every measure of the request on the same batches and map, in order.

        Args:
            on_result: ``on_result(key, result, seconds)`` as each measure finishes (progress, stores, Ctrl-C).

        Returns:
            ``{key: SharpnessResult}`` in the request's order.
        """
        extra = {"profile_points": self.request.profile_points} if self.request.profile_points else {}
        if self.note and not symmetry_noted():
            logger.warning(self.note)
        with symmetry_note_given():  # said above, once, in the request's words
            return run_measures(self.request.keys, self.request.model, self.batches, self.request.settings,
                                on_result=on_result, **self._options(), **extra)

    def measure_one(self, key: str, settings: Settings | None = None) -> SharpnessResult:
        """One measure on the prepared batches and map, with ``settings`` (default: the request's).

        Args:
            key: a registry key.
            settings: the settings of this one measure (a leaderboard column's mode).

        Returns:
            Its :class:`SharpnessResult`.
        """
        return run_measure(key, self.request.model, self.batches, settings or self.request.settings,
                           **self._options())

    def estimate_seconds(self) -> float:
        """Seconds the measures will take: each solves the first batch with one solver step (timed: its set-up, the
        clean loss and one step, so two passes), scaled to the passes of the run (``steps + 1`` per batch, or
        ``n_samples + 1``) on this process's share of the batches (all of them when the model is sharded, and then
        every rank must call it). Costs about ``1 / (steps + 1)`` of one batch per measure (relative flatness and the
        Hessian's top eigenvalue, which take no steps, are timed on the whole first batch; the Hessian's trace on one
        Hutchinson sample). With ``steps="auto"`` it counts the first block of steps, which the solver may stop early
        or extend: a guide, not a bound.

        Returns:
            The estimate in seconds.
        """
        settings = self.request.settings
        probe = dataclasses.replace(settings, steps=1, n_samples=1)
        steps = settings.steps if isinstance(settings.steps, int) else AUTO_BLOCK

        def passes(key: str) -> float:  # in units of the probe's two passes
            if spec(key).family in ("relative_flatness", "hessian_top_eigenvalue"):
                return 2.0  # the probe is the whole batch
            if spec(key).family == "hessian_trace":
                return settings.n_samples + 1  # the probe is one Hutchinson sample
            return (settings.n_samples if settings.mode == "average" else steps) + 1

        seconds = 0.0
        library = logging.getLogger("hf_geosharp")
        level = library.level
        library.setLevel(logging.ERROR)  # one step never converges: that is no news about the run
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for key in self.request.keys:
                    start = time.perf_counter()
                    run_measure(key, self.request.model, self.batches[:1], probe, symmetry_map=self.symmetry_map,
                                progress=False)
                    seconds += (time.perf_counter() - start) * passes(key) / 2
        finally:
            library.setLevel(level)
        ranks = 1 if self.sharded else self.world  # sharded, every rank solves every batch
        return seconds * math.ceil(len(self.batches) / ranks)


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _rows_of_rank(batches: list, world: int) -> list:
    """This rank's rows of every batch (``tensor_split``: the ranks' rows in order, together the batch)."""
    rank = torch.distributed.get_rank()
    return [{k: v.tensor_split(world)[rank] for k, v in b.items()} for b in batches]


def prepare(request: Request) -> Prepared:
    """Map the symmetries (on the unsharded model), shard it under ``fsdp`` and share the batches across the ranks.

    Args:
        request: what to measure.

    Returns:
        The :class:`Prepared` request: its map, whether sharded, its batches on this rank.
    """
    keys = request.keys  # an unknown measure is refused before any work
    smap = request.symmetry_map
    if smap is None and (request.map_always or request.fsdp or any(spec(k).family == "geodesic" for k in keys)):
        smap = symmetry_map(request.model)
    report = None if smap is None else smap.summary(request.model if request.conditioning else None)
    note = no_symmetry_note(smap, request.name) if request.geodesic else None
    if request.fsdp and not is_sharded(request.model):  # mapped above, on the unsharded model
        shard_model(request.model, placement=attention_placement(request.model, smap))
    sharded, world = is_sharded(request.model), _world()
    held = smap if request.symmetry_map is not None or sharded else None
    del smap  # a map made here for the report or the note is not held through the solves
    batches, accelerator = list(request.batches), request.accelerator
    if world > 1 and request.share_batches:
        accelerator = None if sharded else accelerator or launch_accelerator()
    if sharded:
        rows = [len(next(iter(b.values()))) for b in batches]
        if (world > 1 and request.share_rows and request.task == "classification" and request.loss_fn is None
                and min(rows) >= world):
            batches = _rows_of_rank(batches, world)
    return Prepared(request, held, report, note, sharded, world, batches, accelerator)


def measure(request: Request, on_result: OnResult | None = None) -> dict[str, SharpnessResult]:
    """Prepare ``request`` and run its measures: the whole pipeline in one call.

    Args:
        request: what to measure.
        on_result: ``on_result(key, result, seconds)`` as each measure finishes.

    Returns:
        ``{key: SharpnessResult}`` in the request's order.
    """
    return prepare(request).measure(on_result)


def gathered_rows(columns: dict[str, list]) -> dict[str, list]:
    """Every rank's rows, concatenated in rank order: what one process would have been given (each rank passes its
    share of the examples; a ``ValueError`` when the ranks passed different inputs).

    Args:
        columns: this rank's inputs, ``{name: rows}``.

    Returns:
        The inputs of all ranks.
    """
    shards: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shards, columns)
    names = {tuple(sorted(s)) for s in shards}
    if len(names) != 1:
        raise ValueError(f"ranks passed different inputs to compute(): {sorted(names)}; pass the same ones everywhere.")
    return {k: [row for shard in shards for row in shard[k]] for k in columns}
