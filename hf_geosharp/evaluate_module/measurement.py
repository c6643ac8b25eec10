"""The evaluate face: ``evaluate.load("geodesic_sharpness")`` returns :class:`GeodesicSharpness`.

Data arrive as evaluate features (raw texts as ``predictions``, like evaluate's perplexity module, or token ids and
masks, or pixel values, and labels); the model arrives as a keyword (``model=`` or ``model_id=``). The measures, their
output keys and their defaults come from :mod:`hf_geosharp.measures`, the batching from :mod:`hf_geosharp.data`.

Labels are stored with the dtype the model's task needs: class ids as integers, regression and multi-label targets as
floats (evaluate picks a feature schema from the first example; here it is picked from all labels' types, so a float
target is never truncated to an integer).

Inputs are checked before evaluate stores them and before any work (:func:`check_values`): token ids must be integers
(evaluate's int64 schema would truncate a float silently), no example may have ``None`` for an input it was given, and
``tokenizer=`` must be a tokenizer object, not a name.

evaluate stores every declared feature for every example, but a text model has no pixels and many tokenizers make no
``token_type_ids``. Inputs that are not given are therefore stored as empty rows, and a column whose rows are all empty
counts as absent.

Distributed use: every rank calls ``compute`` on its own shard, with ``evaluate.load(..., keep_in_memory=True)``. The
shards are all-gathered in rank order, batched exactly as one process would batch the concatenation, and the engine
then spreads the batches over the ranks (through ``accelerate``) and gathers the per-batch values, so every rank returns
the one-process result. Do not use evaluate's ``num_process``/``process_id`` options: they make rank 0 compute alone.

Sharded use (FSDP2): under ``torchrun``, ``compute(model_id=..., fsdp=True)`` loads the model on every rank, maps its
symmetries and shards it (through :mod:`hf_geosharp.pipeline`, with
:func:`hf_geosharp.engine.placement.sharding.shard_model`); a ``model=`` the user sharded is
measured sharded without the flag. The shards of the examples are joined and batched as above, and every rank then
solves every batch together with the others: for a loss that is a mean over examples (classification) each rank passes
the engine its rows of every batch (compute is shared too); otherwise (token-averaged losses, a custom ``loss_fn``, a
batch with fewer rows than ranks) every rank passes the whole batches. Either way every rank returns the one-process
result.
"""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing
from collections.abc import Callable
from typing import Any

import datasets
import evaluate
import numpy as np
import torch

from ..data import (
    DataError,
    DataSpec,
    load_processor,
    make_batches,
    require_task,
    task_of,
)
from ..engine.result import certified
from ..measures import DEFAULT_MEASURES, MEASURES, Settings, parse_measures, result_fields, setting_help
from ..pipeline import ModelSource, Request, gathered_rows, init_distributed, is_sharded, load, prepare
from .register import quiet_cache_notice

INPUTS = ("predictions", "input_ids", "attention_mask", "token_type_ids", "pixel_values", "labels")
#: Inputs stored as int64: a float there would be truncated without a word, so it is refused.
INTEGER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")

_DESCRIPTION = """\
Geodesic sharpness (da Silva, Dangel & Oore, ICML 2025) measures how much a model's loss rises when its weights move a
distance rho along geodesics of a Riemannian metric on the quotient of weight space by the attention symmetries
(GL(h) on every query/key and value/output pair). Unlike adaptive sharpness, it does not change when a transformer is
reparametrised along those symmetries, which leave the function unchanged. It is reported next to adaptive sharpness
(Andriushchenko et al., ICML 2023) as a baseline.
"""

_CITATION = """\
@inproceedings{dasilva2025hideandseek,
  title     = {Hide \\& Seek: Transformer Symmetries Obscure Sharpness \\& Riemannian Geometry Finds It},
  author    = {da Silva, M. F. and Dangel, F. and Oore, S.},
  booktitle = {Proceedings of the 42nd International Conference on Machine Learning (ICML)},
  year      = {2025},
  note      = {arXiv:2505.05409}
}
@software{hf_geosharp,
  title   = {hf_geosharp: geodesic sharpness for Hugging Face transformers},
  version = {0.1.0},
  year    = {2025}
}
"""

DEFAULTS = Settings()
DEFAULT_BATCH_SIZE = DataSpec.batch_size  # the CLI's defaults (dataclass field defaults)
DEFAULT_MAX_LENGTH = DataSpec.max_length
#: The shared settings, in declaration order: each is a keyword of ``compute`` (default ``None``: the declared one).
SETTING_NAMES = tuple(field.name for field in dataclasses.fields(Settings))
#: What this module adds to a setting's declared meaning, where its output or its batching says more.
_SETTING_NOTES = {
    "steps": "`<key>_certified` says whether a worst-case value is certified",
    "seed": "each batch is seeded from (seed, batch index)",
}


def _type_text(hint: Any) -> str:
    """A type as the argument list shows it: `int`, "auto", `int` or "auto"."""
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(f'"{value}"' for value in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_text(arg) for arg in typing.get_args(hint))
    return f"`{hint.__name__}`"


def _value_text(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def settings_text() -> str:
    """The argument list's entries of the shared settings, derived from :class:`~hf_geosharp.measures.Settings`: each
    field's type, default and declared meaning (:func:`~hf_geosharp.measures.setting_help`), one entry per field.

    Returns:
        The entries, indented as in ``_KWARGS_DESCRIPTION``.
    """
    hints = typing.get_type_hints(Settings)
    entries = []
    for name in SETTING_NAMES:
        meaning = "; ".join(filter(None, (setting_help(name), _SETTING_NOTES.get(name))))
        entry = f"{name} ({_type_text(hints[name])}, default {_value_text(getattr(DEFAULTS, name))}): {meaning}."
        entries.append(textwrap.fill(entry, 120, initial_indent="    ", subsequent_indent="        ",
                                     break_on_hyphens=False))
    return "\n".join(entries)


def settings_from(given: dict[str, Any]) -> Settings:
    """The settings of one ``compute``: the declared defaults, replaced by the keywords given (``None``: not given).

    Args:
        given: setting name -> value or ``None``, for names of :data:`SETTING_NAMES`.

    Returns:
        The :class:`~hf_geosharp.measures.Settings` of the call.
    """
    return dataclasses.replace(DEFAULTS, **{k: v for k, v in given.items() if v is not None})


_SETTINGS_TEXT = settings_text()

_KWARGS_DESCRIPTION = f"""
Args:
    predictions (`list[str]`): raw texts, tokenized with the model's tokenizer (like evaluate's perplexity module);
        or instead:
    input_ids (`list[list[int]]`): token ids of a text model, one list per example (any lengths; padded per batch).
    attention_mask (`list[list[int]]`, *optional*): built from the lengths when not given.
    token_type_ids (`list[list[int]]`, *optional*): for models that take them (BERT).
    pixel_values (`list` or tensor `[n, channels, height, width]`): inputs of a vision model (instead of input_ids).
    labels: what the model's loss needs: class ids (`list[int]`), regression or multi-label targets (`list[float]`,
        `list[list[float]]`), or per-token ids (`list[list[int]]`, -100: ignored). Class names must be mapped to
        ids first (`model.config.label2id`). Optional for causal language models (labels = the input ids).
    model (`torch.nn.Module`): a loaded model with a task head; `model(**batch).loss` is measured. Never modified,
        never moved.
    model_id (`str`): instead of `model`, a local path or Hub id, loaded with the head its config names (custom
        model code is never run).
    tokenizer (*optional*): a tokenizer object that tokenizes `predictions` (not a name: load it with
        `AutoTokenizer.from_pretrained(name)`); default the one saved with `model_id`.
    device (`str`, *optional*): where a `model_id` model runs (default: cuda when available, else cpu); a `model` stays
        where it is.
    measures (`str` or `list`, *optional*): measure keys or short forms ("inv", "mix", "adaptive"); default
        "{",".join(DEFAULT_MEASURES)}". The older `metric=` ("inv,mix") and `baseline=` select the same.
    batch_size (`int`, default {DEFAULT_BATCH_SIZE}): examples per batch; values are averaged over batches.
    max_length (`int`, default {DEFAULT_MAX_LENGTH}): truncation length when tokenizing `predictions`.
{_SETTINGS_TEXT}
    loss_fn (`callable`, *optional*): `loss_fn(model, batch) -> scalar tensor` instead of the model's own loss.
    accelerator (`accelerate.Accelerator`, *optional*): created automatically when torch.distributed is running.
    fsdp (`bool`, default False): under `torchrun`, load `model_id` on every rank and shard it with FSDP2 before
        measuring (each rank holds its share of the weights and of the solver state); each rank passes its own
        share of the examples. A `model=` sharded by the user is measured sharded without it.
    progress (`bool`, default False): show progress bars.
Returns:
    for every measure key (`geodesic_sharpness_inv`, `geodesic_sharpness_mix`, `adaptive_sharpness`, ...), whichever
    were asked for (the others are None, so the keys never change): `<key>` (`float`, the mean over batches),
    `<key>_stderr` (its standard error; NaN for a single worst-case batch), `<key>_per_batch` (`list[float]`) and
    `<key>_certified` (`bool`: whether the worst case is certified; False: `<key>` is a lower bound of the maximum,
    and `config["results"][key]["convergence_note"]` says why; None for the average case and relative flatness,
    which have no certificate, and for measures not asked for);
    clean_loss (`float`) and clean_loss_per_batch (`list[float]`): the unperturbed loss;
    config (`dict`): the settings, example and batch counts, world size, each measure's engine name, convergence and
        configuration, and the attention modules that could not be mapped (treated elementwise), with the reason.
Examples:
    >>> import evaluate
    >>> gs = evaluate.load("geodesic_sharpness")
    >>> gs.compute(model_id="path/to/model", predictions=["a fine film", "dull"], labels=[1, 0], batch_size=32)
"""


def _features(text: Any, labels: Any) -> datasets.Features:
    ids = datasets.Sequence(datasets.Value("int64"))
    pixels = datasets.Sequence(datasets.Sequence(datasets.Sequence(datasets.Value("float32"))))
    return datasets.Features({"predictions": text, "input_ids": ids, "attention_mask": ids, "token_type_ids": ids,
                              "pixel_values": pixels, "labels": labels})  # fmt: skip


#: One schema per label kind, indexed by :func:`_label_kind`: (scalar or per-example list) x (integer or float).
SCHEMAS = [
    _features(datasets.Value("string"), labels)
    for labels in (
        datasets.Value("int64"), datasets.Value("float64"),
        datasets.Sequence(datasets.Value("int64")), datasets.Sequence(datasets.Value("float64")),
    )
]  # fmt: skip


def _label_kind(rows: Any) -> int:
    """Which schema the labels need: +2 for per-example lists, +1 for floats; strings are refused here, before
    evaluate's own type inference turns them into an unrelated error."""
    values, nested = [], False
    for row in rows:
        if np.ndim(row) > 0:
            nested = True
            values.extend(np.asarray(row).ravel().tolist())
        else:
            values.append(row.item() if hasattr(row, "item") else row)
    text = next((v for v in values if isinstance(v, str)), None)
    if text is not None:
        raise ValueError(
            f"labels are class names (e.g. {text!r}); pass class ids: map them with the model's label2id, e.g. "
            "labels=[model.config.label2id[name] for name in names]."
        )
    return 2 * nested + any(isinstance(v, float) for v in values)


def _bad_value(value: Any, integers: bool, deep: bool = True) -> str | None:
    """What is wrong with one example's input, or ``None``: it is ``None`` (anywhere in it, with ``deep``), or it holds
    a float where ``integers`` belong."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor" if integers and (value.is_floating_point() or value.is_complex()) else None
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return _bad_value(value.ravel().tolist(), integers, deep) if deep else None
        exact = np.issubdtype(value.dtype, np.integer) or value.dtype == np.bool_
        return f"a {value.dtype} array" if integers and not exact else None
    if deep and isinstance(value, (list, tuple)):
        return next((bad for v in value if (bad := _bad_value(v, integers)) is not None), None)
    if integers and isinstance(value, (float, np.floating, complex)):
        return f"the float {value!r}"
    return None


def check_values(kwargs: dict[str, Any], *, single: bool = False) -> None:
    """Refuse, before evaluate stores anything and before any work, what would otherwise be changed silently or fail
    without naming its field: float token ids (the int64 schema truncates them), ``None`` for an example's input
    (labels included), and a ``tokenizer=`` that is a name rather than a tokenizer. ``single``: ``add``'s one
    example."""
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is not None and not callable(tokenizer):
        load = (f" (e.g. AutoTokenizer.from_pretrained({tokenizer!r}))" if isinstance(tokenizer, str) else "")
        raise TypeError(f"tokenizer= must be a tokenizer object{load}, got {type(tokenizer).__name__} "
                        f"{tokenizer!r:.60}; or leave it out with model_id= to use the tokenizer saved with the model.")
    for name in ("prediction" if single else "predictions", *INPUTS[1:]):
        given = kwargs.get(name)
        if given is None:
            continue
        integers, deep = name in INTEGER_INPUTS, name != "pixel_values"  # pixels: floats, and too many to walk
        whole = single or isinstance(given, (torch.Tensor, np.ndarray))  # one value, or one dtype for all rows
        for i, row in enumerate([given] if whole else given):
            if (bad := _bad_value(row, integers, deep)) is not None:
                raise ValueError(f"{name if whole else f'{name}[{i}]'} {'is' if bad == 'None' else 'holds'} {bad}: "
                                 f"{_fix(name, bad)}.")


def _fix(name: str, bad: str) -> str:
    if bad == "None" and name == "labels":
        return ("every example needs its label: a class id, a float target, or per-token ids with -100 where ignored; "
                "drop the unlabelled examples")
    if bad == "None":
        return f"every example needs its {name}; drop the examples without them"
    return ("token ids and masks are integers and a float would be truncated; pass integers (the tokenizer's output, "
            "or .long() / .astype(int))")


def _with_absent_inputs(kwargs: dict[str, Any], *, single: bool = False) -> dict[str, Any]:
    """Store every input evaluate expects: one that is not given becomes empty rows (texts: empty strings)."""
    if "references" in kwargs or "reference" in kwargs:
        raise ValueError(
            "geodesic_sharpness takes no references: pass the targets as labels= and the texts as predictions=. "
            "(evaluate.combine does not apply to this module: it hands every module the same predictions and "
            "references, while this one needs a model and the model's inputs.)"
        )
    names = [("prediction" if single else "predictions"), *INPUTS[1:]]
    given = [kwargs[k] for k in names if kwargs.get(k) is not None]
    if not given:
        return kwargs
    n = 1 if single else len(given[0])
    empty = {name: ("" if name.startswith("prediction") else []) for name in names}
    return {**kwargs, **{k: (empty[k] if single else [empty[k]] * n) for k in names if kwargs.get(k) is None}}


def _present(rows: list[Any]) -> bool:
    return any(not (isinstance(r, (list, str)) and len(r) == 0) for r in rows)


def _keys(measures: Any, metric: Any, baseline: bool | None) -> list[str]:
    """The measure keys asked for; ``metric``/``baseline`` are the older way to say the same."""
    if measures is not None:
        return parse_measures(measures)
    if metric is None and baseline is None:
        return list(DEFAULT_MEASURES)
    metrics = [m.strip() for m in metric.split(",")] if isinstance(metric, str) else list(metric or ["inv", "mix"])
    if not metrics or any(m not in ("inv", "mix") for m in metrics):
        raise ValueError(f"metric={metric!r}: use 'inv', 'mix' or 'inv,mix' (or measures=).")
    return parse_measures(metrics + (["adaptive"] if baseline is not False else []))


def _model(model: torch.nn.Module | None, model_id: str | None, device: Any, fsdp: bool) -> torch.nn.Module:
    """The model to measure: the one given (never moved), or ``model_id`` loaded onto ``device`` (with ``fsdp``:
    where it loads; sharding moves each rank's shards to its device)."""
    if (model is None) == (model_id is None):
        raise ValueError("pass exactly one of model= (a loaded model) or model_id= (a local path or Hub id).")
    want = torch.device(device) if device is not None else None
    if fsdp:
        _start_fsdp(model, device)
    if model is None:
        loaded = load(ModelSource(model_id))  # custom model code is never run
        return loaded if fsdp else loaded.to(want or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model= must be a loaded torch.nn.Module, got {type(model).__name__}; pass a folder or Hub id "
                        "as model_id= instead.")  # fmt: skip
    here = next(model.parameters()).device
    if want is not None and (want.type != here.type or want.index not in (None, here.index)):
        raise ValueError(
            f"the model is on {here}, not {want}: compute never moves a model it is given; call "
            f"model.to({str(want)!r}) first, or pass model_id= with device=."
        )
    return model


def _start_fsdp(model: torch.nn.Module | None, device: Any) -> None:
    """Join the launcher's process group for ``fsdp=True``, or say why it cannot apply."""
    if model is not None and not is_sharded(model):
        raise ValueError("fsdp=True shards a model that compute loads (model_id=); compute never modifies a model "
                         "it is given. Shard yours with hf_geosharp.engine.placement.sharding.shard_model(model), then "
                         "compute(model=model) measures it sharded.")  # fmt: skip
    if device is not None:
        raise ValueError("device= does not apply with fsdp=True: each rank uses its own GPU (LOCAL_RANK), or the CPU.")
    try:
        init_distributed()
    except RuntimeError as err:
        raise ValueError(f"fsdp=True needs a distributed launch: {err}") from None


def _output(results: dict, settings: Settings, keys: list[str], config: dict[str, Any],
            report: dict[str, Any] | None) -> dict[str, Any]:
    """Every measure key (``None`` for those not asked for), the clean loss and the configuration."""
    out: dict[str, Any] = {}
    for key in MEASURES:  # every key, always: a result table keeps its columns whatever was asked for
        empty = {key: None, f"{key}_stderr": None, f"{key}_per_batch": None}
        out.update(result_fields(key, results[key]) if key in results else empty)
        out[f"{key}_certified"] = certified(results[key]) if key in results else None
    first = next(iter(results.values()))
    out["clean_loss"], out["clean_loss_per_batch"] = first.clean_loss, list(first.per_batch_clean_loss)
    out["config"] = {
        **settings.as_dict(), "ball": settings.ball, "measures": keys, **config,
        "results": {key: {"measure": res.measure, "converged": res.converged, "convergence_note": res.convergence_note,
                          "steps_used": res.steps_used, "config": res.config} for key, res in results.items()},
        "unmapped_attention": list(report["fallbacks"]) if report else [],
    }  # fmt: skip
    return out


class GeodesicSharpness(evaluate.Measurement):
    """Geodesic (symmetry-invariant) sharpness of a model on labelled examples, with adaptive sharpness as baseline."""

    def _info(self) -> evaluate.MeasurementInfo:
        quiet_cache_notice()  # evaluate builds this module: its later loads from the cache need no notice
        return evaluate.MeasurementInfo(
            module_type="measurement",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=SCHEMAS,
            reference_urls=["https://arxiv.org/abs/2505.05409", "https://openreview.net/forum?id=5QAKPBVdFH"],
        )

    def _infer_feature_from_batch(self, batch: dict[str, list]) -> datasets.Features:
        return self.features[_label_kind(batch["labels"])]

    def _infer_feature_from_example(self, example: dict[str, Any]) -> datasets.Features:
        return self.features[_label_kind([example["labels"]])]

    def _check_labels(self, labels: Any) -> None:
        """Later batches must have the label kind of the first (evaluate would cast them to its dtype)."""
        if labels is not None and self.writer is not None:
            kind = _label_kind(labels)
            if self.features[kind] != self.selected_feature_format:
                raise ValueError(
                    "these labels are of another kind (integer/float, scalar/list) than the ones "
                    "added before; pass all labels with one dtype."
                )

    def compute(self, **kwargs: Any) -> dict[str, Any] | None:
        """Measure sharpness; see the arguments below."""
        check_values(kwargs)
        kwargs = _with_absent_inputs(kwargs)
        self._check_labels(kwargs.get("labels"))
        return super().compute(**kwargs)

    def add_batch(self, **kwargs: Any) -> None:
        """Add a batch of examples; ``compute(model=...)`` then measures all added examples."""
        check_values(kwargs)
        kwargs = _with_absent_inputs(kwargs)
        self._check_labels(kwargs.get("labels"))
        super().add_batch(**kwargs)

    def add(self, **kwargs: Any) -> None:
        """Add one example."""
        check_values(kwargs, single=True)
        kwargs = _with_absent_inputs(kwargs, single=True)
        self._check_labels([kwargs["labels"]] if "labels" in kwargs else None)
        super().add(**kwargs)

    def _compute(
        self,
        predictions: list,
        input_ids: list,
        attention_mask: list,
        token_type_ids: list,
        pixel_values: list,
        labels: list,
        model: torch.nn.Module | None = None,
        model_id: str | None = None,
        tokenizer: Any = None,
        device: Any = None,
        measures: Any = None,
        metric: Any = None,
        baseline: bool | None = None,
        rho: float | None = None,
        mode: str | None = None,
        steps: int | None = None,
        n_samples: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_length: int = DEFAULT_MAX_LENGTH,
        seed: int | None = None,
        epsilon: float | None = None,
        ball: str | None = None,
        adaptive_variant: str | None = None,
        compile: str | None = None,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        accelerator: Any = None,
        progress: bool = False,
        fsdp: bool = False,
    ) -> dict[str, Any]:
        keys = _keys(measures, metric, baseline)
        settings = settings_from(dict(rho=rho, mode=mode, steps=steps, n_samples=n_samples, seed=seed, epsilon=epsilon,
                                      ball=ball, adaptive_variant=adaptive_variant, compile=compile))
        model = _model(model, model_id, device, fsdp)
        task = task_of(model)
        if task is None and loss_fn is None:
            require_task(model)  # says which heads have a loss (the real cause, before any word about labels)
        inputs = dict(zip(INPUTS, (predictions, input_ids, attention_mask, token_type_ids, pixel_values, labels)))
        columns = {k: rows for k, rows in inputs.items() if _present(rows)}
        if sum(k in columns for k in ("predictions", "input_ids", "pixel_values")) != 1:
            raise ValueError("pass one of predictions= (texts), input_ids= (token ids) or pixel_values= (images).")
        pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        if "predictions" in columns:
            if tokenizer is None and model_id is None:
                raise ValueError("predictions= are texts: pass the model's tokenizer= with model=, or use model_id=.")
            tokenizer = tokenizer if tokenizer is not None else load_processor(model_id, model, trust_remote_code=False)
            enc = tokenizer(columns.pop("predictions"), truncation=True, max_length=max_length)
            columns.update({k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc})
            if pad_token_id is None:
                pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if "labels" not in columns and loss_fn is None and task != "causal-lm":
            raise ValueError(
                "labels= is missing: pass class ids (or per-token ids with -100 for ignored positions); only causal "
                "language models take their labels from input_ids."
            )
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world_size > 1:
            columns = gathered_rows(columns)
        try:
            batches = make_batches(columns, batch_size, pad_token_id=pad_token_id, task=task)
        except DataError as err:
            raise ValueError(str(err)) from None
        prepared = prepare(Request(model, batches, keys, settings, loss_fn=loss_fn, fsdp=fsdp, share_rows=True,
                                   task=task, accelerator=accelerator, share_batches=True,
                                   progress=progress))
        results = prepared.measure()
        config = {"batch_size": batch_size, "n_examples": len(next(iter(columns.values()))),
                  "n_batches": len(batches), "world_size": world_size, "fsdp": prepared.sharded}  # fmt: skip
        return _output(results, settings, keys, config, prepared.symmetry_report)
