"""The evaluate face: ``evaluate.load("geodesic_sharpness")`` returns :class:`GeodesicSharpness`.

Data arrive as evaluate features (token ids and masks, or pixel values, and labels); the model arrives as a keyword,
like in evaluate's perplexity module. All the work is delegated to :mod:`hf_geosharp.api`.

evaluate stores every declared feature for every example, but a text model has no pixels and many tokenizers make no
``token_type_ids``. Inputs that are not given are therefore stored as empty rows, and a column whose rows are all empty
counts as absent.

Distributed use: every rank calls ``compute`` on its own shard, with ``evaluate.load(..., keep_in_memory=True)``. The
shards are all-gathered in rank order, batched exactly as one process would batch the concatenation, and the engine
then spreads the batches over the ranks (through ``accelerate``) and gathers the per-batch values, so every rank returns
the one-process result. Do not use evaluate's ``num_process``/``process_id`` options: they make rank 0 compute alone.
"""

from __future__ import annotations

from typing import Any, Callable

import datasets
import evaluate
import torch

from .api import adaptive_sharpness, geodesic_sharpness
from .data import DataError, launch_accelerator, load_model, make_batches, task_of
from .symmetry import map_symmetries

INPUTS = ("input_ids", "attention_mask", "token_type_ids", "pixel_values", "labels")
METRICS = ("inv", "mix")

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

_KWARGS_DESCRIPTION = """
Args:
    input_ids (`list[list[int]]`): token ids of a text model, one list per example (any lengths; padded per batch).
    attention_mask (`list[list[int]]`, *optional*): built from the lengths when not given.
    token_type_ids (`list[list[int]]`, *optional*): for models that take them (BERT).
    pixel_values (`list` or tensor `[n, channels, height, width]`): inputs of a vision model (instead of input_ids).
    labels (`list[int]` or `list[list[int]]`): class ids, or per-token ids (-100: ignored). Optional for causal LMs,
        whose labels default to the input ids.
    model (`torch.nn.Module`): a loaded model; `model(**batch).loss` is what is measured. Not modified.
    model_id (`str`): instead of `model`, a local path or Hub id, loaded with the head its config names.
    rho (`float`, default 0.1): radius of the perturbation ball.
    metric (`str`, default "inv"): "inv", "mix" or "inv,mix" (several give one key per metric).
    mode (`str`, default "worst"): "worst" (maximise the loss over the ball) or "average" (random directions).
    steps (`int`, default 20): solver iterations per batch (worst case).
    n_samples (`int`, default 20): random directions per batch (average case).
    batch_size (`int`, default 32): examples per batch; values are averaged over batches.
    seed (`int`, default 0): every batch's randomness is seeded from (seed, batch index).
    baseline (`bool`, default True): also compute adaptive sharpness on the same batches.
    epsilon (`float`, default 1e-6): regulariser of the metric's Gram matrices.
    loss_fn (`callable`, *optional*): `loss_fn(model, batch) -> scalar tensor` instead of the model's own loss.
    accelerator (`accelerate.Accelerator`, *optional*): created automatically when torch.distributed is running.
    progress (`bool`, default False): show progress bars.
Returns:
    geodesic_sharpness (`float`): the mean over batches (`geodesic_sharpness_inv`, `_mix` for several metrics),
    geodesic_sharpness_per_batch (`list[float]`),
    adaptive_sharpness (`float`) and adaptive_sharpness_per_batch (`list[float]`) when baseline=True,
    clean_loss (`float`) and clean_loss_per_batch (`list[float]`): the unperturbed loss,
    config (`dict`): the settings, example and batch counts, world size, each measure's own configuration, and the
        attention modules that could not be mapped (treated elementwise), with the reason.
Examples:
    >>> import evaluate
    >>> gs = evaluate.load("geodesic_sharpness")
    >>> enc = tokenizer(texts, truncation=True)
    >>> gs.compute(model=model, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels,
    ...            rho=0.1, metric="inv,mix", steps=20, batch_size=32)
"""


def _features(labels: datasets.Value | datasets.Sequence) -> datasets.Features:
    ids = datasets.Sequence(datasets.Value("int64"))
    pixels = datasets.Sequence(datasets.Sequence(datasets.Sequence(datasets.Value("float32"))))
    return datasets.Features(
        {"input_ids": ids, "attention_mask": ids, "token_type_ids": ids, "pixel_values": pixels, "labels": labels}
    )


def _with_absent_inputs(kwargs: dict[str, Any], *, single: bool = False) -> dict[str, Any]:
    """Store every input evaluate expects: one that is not given becomes empty rows (one ``[]`` for ``add``)."""
    given = [kwargs[k] for k in INPUTS if kwargs.get(k) is not None]
    if not given:
        return kwargs
    empty: list = [] if single else [[] for _ in range(len(given[0]))]
    return {**kwargs, **{k: empty for k in INPUTS if kwargs.get(k) is None}}


def _present(rows: list[Any]) -> bool:
    return any(not (isinstance(r, list) and len(r) == 0) for r in rows)


def _gather_shards(columns: dict[str, list]) -> dict[str, list]:
    """Every rank's rows, concatenated in rank order: what a single process would have been given."""
    shards: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(shards, columns)
    keys = {tuple(sorted(s)) for s in shards}
    if len(keys) != 1:
        raise ValueError(f"ranks passed different inputs to compute(): {sorted(keys)}; pass the same ones everywhere.")
    return {k: [row for shard in shards for row in shard[k]] for k in columns}


class GeodesicSharpness(evaluate.Measurement):
    """Geodesic (symmetry-invariant) sharpness of a model on labelled batches, with adaptive sharpness as baseline."""

    def _info(self) -> evaluate.MeasurementInfo:
        return evaluate.MeasurementInfo(
            module_type="measurement",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[_features(datasets.Value("int64")), _features(datasets.Sequence(datasets.Value("int64")))],
            reference_urls=["https://arxiv.org/abs/2505.05409", "https://openreview.net/forum?id=5QAKPBVdFH"],
        )

    def compute(self, **kwargs: Any) -> dict[str, Any] | None:
        """Measure sharpness; see the arguments below."""
        return super().compute(**_with_absent_inputs(kwargs))

    def add_batch(self, **kwargs: Any) -> None:
        """Add a batch of examples; ``compute(model=...)`` then measures all added examples."""
        super().add_batch(**_with_absent_inputs(kwargs))

    def add(self, **kwargs: Any) -> None:
        """Add one example."""
        super().add(**_with_absent_inputs(kwargs, single=True))

    def _compute(
        self,
        input_ids: list,
        attention_mask: list,
        token_type_ids: list,
        pixel_values: list,
        labels: list,
        model: torch.nn.Module | None = None,
        model_id: str | None = None,
        rho: float = 0.1,
        metric: str = "inv",
        mode: str = "worst",
        steps: int = 20,
        n_samples: int = 20,
        batch_size: int = 32,
        seed: int = 0,
        baseline: bool = True,
        epsilon: float = 1e-6,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        accelerator: Any = None,
        progress: bool = False,
    ) -> dict[str, Any]:
        if (model is None) == (model_id is None):
            raise ValueError("pass exactly one of model= (a loaded model) or model_id= (a local path or Hub id).")
        if model is None:
            model = load_model(model_id)
        metrics = [m.strip() for m in metric.split(",")] if isinstance(metric, str) else list(metric)
        if not metrics or any(m not in METRICS for m in metrics):
            raise ValueError(f"metric={metric!r}: use 'inv', 'mix' or 'inv,mix'.")
        inputs = dict(zip(INPUTS, (input_ids, attention_mask, token_type_ids, pixel_values, labels)))
        columns = {k: rows for k, rows in inputs.items() if _present(rows)}
        if ("input_ids" in columns) == ("pixel_values" in columns):
            raise ValueError("pass either input_ids= (text) or pixel_values= (vision), not both and not neither.")
        task = task_of(model)
        if "labels" not in columns and loss_fn is None and task != "causal-lm":
            raise ValueError(
                "labels= is missing: pass class ids (or per-token ids with -100 for ignored positions); only causal "
                "language models take their labels from input_ids."
            )
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world_size > 1:
            columns = _gather_shards(columns)
            accelerator = accelerator or launch_accelerator()
        try:
            batches = make_batches(
                columns,
                batch_size,
                pad_token_id=getattr(getattr(model, "config", None), "pad_token_id", None),
                task=task,
            )
        except DataError as err:
            raise ValueError(str(err)) from None
        common = dict(
            rho=rho, mode=mode, steps=steps, seed=seed, n_samples=n_samples, loss_fn=loss_fn,
            accelerator=accelerator, progress=progress,
        )  # fmt: skip
        smap = map_symmetries(model)  # once for all metrics
        results = [
            geodesic_sharpness(model, batches, metric=m, epsilon=epsilon, symmetry_map=smap, **common) for m in metrics
        ]
        if baseline:
            results.append(adaptive_sharpness(model, batches, **common))
        out: dict[str, Any] = {}
        for m, res in zip(metrics, results):
            key = "geodesic_sharpness" if len(metrics) == 1 else f"geodesic_sharpness_{m}"
            out[key], out[f"{key}_per_batch"] = res.value, list(res.per_batch)
        if baseline:
            out["adaptive_sharpness"] = results[-1].value
            out["adaptive_sharpness_per_batch"] = list(results[-1].per_batch)
        out["clean_loss"], out["clean_loss_per_batch"] = results[0].clean_loss, list(results[0].per_batch_clean_loss)
        out["config"] = {
            "rho": rho, "metric": ",".join(metrics), "mode": mode, "steps": steps, "n_samples": n_samples,
            "batch_size": batch_size, "seed": seed, "epsilon": epsilon, "baseline": baseline,
            "n_examples": len(next(iter(columns.values()))), "n_batches": len(batches), "world_size": world_size,
            "measures": {res.measure: res.config for res in results},
            "unmapped_attention": [{"module": f.module, "reason": f.reason} for f in smap.fallbacks],
        }  # fmt: skip
        return out
