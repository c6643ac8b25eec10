"""Model-card entries: sharpness results as ``model-index`` eval results, written locally or proposed as a Hub PR.

Hugging Face users look for a model's numbers in its card, so a measurement is only published once it is there. The
card is edited with ``huggingface_hub.ModelCard``/``EvalResult`` (never by hand-written YAML): every other field and
all of the card's prose survive, and a result whose configuration (measure, rho, steps, epsilon, data, split, ...)
matches an existing entry replaces it instead of adding a duplicate, so rerunning a measurement updates the card.

Pushing goes through ``ModelCard.push_to_hub(create_pr=True)`` with the user's token: the owner reviews the change.
``evaluate.push_to_hub`` is not used: it has no ``create_pr`` or token option and breaks on huggingface_hub 2.x.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from . import __version__
from .api import geodesic_sharpness

logger = logging.getLogger(__name__)

METRIC_TYPE = "geodesic_sharpness"
SOURCE_NAME = f"hf_geosharp {__version__}"
SOURCE_URL = "https://pypi.org/project/hf_geosharp/"
_TASKS = {  # transformers head class suffix -> Hub task type
    "ImageClassification": "image-classification",
    "SequenceClassification": "text-classification",
    "CausalLM": "text-generation",
    "MaskedLM": "fill-mask",
}
_ABLATIONS = ("second_order", "riemannian_norm", "horizontal_projection", "elementwise_curvature", "step_normalization")


class CardError(ValueError):
    """A card cannot be written or pushed; the message says what to change."""


@dataclass
class DatasetInfo:
    """Which data a result was measured on, as the card's ``dataset`` block shows it."""

    type: str
    name: str
    split: str
    config: str | None = None
    args: dict[str, Any] | None = None


def task_type(model_class: str | None) -> str:
    """The Hub task of a transformers head class (``ViTForImageClassification`` -> ``image-classification``)."""
    for suffix, task in _TASKS.items():
        if model_class and model_class.endswith(suffix):
            return task
    return "other"


def eval_result(result: dict[str, Any], dataset: DatasetInfo, task: str) -> EvalResult:
    """One card entry from a ``SharpnessResult.to_dict()``: the measure names the config, its settings are the args."""
    measure, config = result["measure"], result.get("config", {})
    if measure == "relative_flatness":  # no rho, no solver: its layer and Hutchinson samples are its settings
        return EvalResult(
            task_type=task, dataset_type=dataset.type, dataset_name=dataset.name, dataset_config=dataset.config,
            dataset_split=dataset.split, dataset_args=dataset.args, metric_type=METRIC_TYPE,
            metric_name=f"Relative flatness (layer {config.get('layer')})", metric_value=float(result["value"]),
            metric_config=measure, source_name=SOURCE_NAME, source_url=SOURCE_URL,
            metric_args={k: config[k] for k in ("layer", "n_samples", "seed", "n_batches")
                         if config.get(k) is not None},
        )
    geodesic = measure.startswith("geodesic")
    budget = "steps" if config["mode"] == "worst" else "n_samples"  # the solver's effort that matters in this mode
    args: dict[str, Any] = {
        "rho": config["rho"],
        "metric": config.get("metric") if geodesic else "adaptive",
        "mode": config["mode"],
        budget: config[budget],
        "seed": config.get("seed"),
        "n_batches": config.get("n_batches"),
    }
    if geodesic:
        args["epsilon"] = config.get("epsilon")
        defaults = inspect.signature(geodesic_sharpness).parameters
        args.update({k: config[k] for k in _ABLATIONS if k in config and config[k] != defaults[k].default})
    elif "variant" in config:
        args["variant"] = config["variant"]
    kind = f"{config.get('metric')}, " if geodesic else ""
    name = f"{'Geodesic' if geodesic else 'Adaptive'} sharpness ({kind}{config['mode']} case, rho={config['rho']})"
    return EvalResult(
        task_type=task, dataset_type=dataset.type, dataset_name=dataset.name, dataset_config=dataset.config,
        dataset_split=dataset.split, dataset_args=dataset.args, metric_type=METRIC_TYPE, metric_name=name,
        metric_value=float(result["value"]), metric_config=measure,
        metric_args={k: v for k, v in args.items() if v is not None},
        source_name=SOURCE_NAME, source_url=SOURCE_URL,
    )


def read_results(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The results and their context from a ``geosharp run --json`` file, or from ``SharpnessResult.to_dict()``
    output (one dict or a list)."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise CardError(f"cannot read results file {str(path)!r}: {err}") from None
    if isinstance(payload, dict) and "results" in payload:
        results, context = payload["results"], payload
        results = list(results.values()) if isinstance(results, dict) else results
    else:
        results, context = (payload if isinstance(payload, list) else [payload]), {}
    bad = [r for r in results if not (isinstance(r, dict) and {"measure", "value", "config"} <= set(r))]
    if bad or not results:
        raise CardError(
            f"{str(path)!r} holds no sharpness results; pass the JSON written by `geosharp run --json` or "
            "SharpnessResult.to_dict() output."
        )
    return results, context


def dataset_info(context: dict[str, Any], *, name: str | None = None, split: str | None = None) -> DatasetInfo:
    """The dataset block from a run's recorded data settings; ``name``/``split`` override (required without them)."""
    data = context.get("data") or {}
    dataset = name or data.get("dataset")
    if not dataset:
        raise CardError("the results do not say which dataset they were measured on; pass --dataset NAME.")
    dataset_type = Path(dataset).name if Path(dataset).exists() else dataset.partition(":")[0]
    args = {k: data[k] for k in ("n_examples", "batch_size", "seed") if data.get(k) is not None} or None
    return DatasetInfo(type=dataset_type, name=dataset_type, split=split or data.get("split") or "train",
                       config=data.get("config") or (dataset.partition(":")[2] or None), args=args)


def _same_config(a: EvalResult, b: EvalResult) -> bool:
    """Same measurement (everything but the value, the display name and the library version that produced it)."""
    ignore = {"metric_value", "metric_name", "source_name", "source_url", "verified", "verify_token"}
    return all(getattr(a, k) == getattr(b, k) for k in vars(a) if k not in ignore)


def merge(card: ModelCard, new: list[EvalResult], model_name: str) -> ModelCard:
    """Add ``new`` to the card's eval results, replacing entries with the same configuration; all else is kept."""
    kept = [old for old in (card.data.eval_results or []) if not any(_same_config(old, n) for n in new)]
    card.data.model_name = card.data.model_name or model_name
    card.data.eval_results = kept + new
    return card


def card_yaml(new: list[EvalResult], model_name: str) -> str:
    """The ``model-index`` YAML of ``new`` alone: the snippet to paste into a card's front matter."""
    return ModelCardData(model_name=model_name, eval_results=new).to_yaml()


def write_card(target: str | Path, new: list[EvalResult], model_name: str | None = None) -> Path:
    """Merge ``new`` into ``target`` (a README.md, or a model folder holding one); create the card if needed."""
    path = Path(target)
    path = path / "README.md" if path.is_dir() or not path.suffix else path
    name = model_name or path.parent.name
    if path.exists():
        card = ModelCard.load(path)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        card = ModelCard(f"---\ntags:\n- hf_geosharp\n---\n\n# {name}\n\nSharpness measured with hf_geosharp.\n")
    merge(card, new, name)
    card.save(path)
    logger.debug("wrote %d eval result(s) into %s", len(new), path)
    return path


def require_online(repo_id: str) -> None:
    """Refuse to push when huggingface_hub is offline, before any network use."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise CardError(
            f"cannot push to {repo_id!r}: the Hugging Face Hub is offline (HF_HUB_OFFLINE=1), so nothing was sent or "
            "written. Unset HF_HUB_OFFLINE on a machine with network access, or run without --push to write the "
            "local card only."
        )


def push_card(repo_id: str, new: list[EvalResult], *, token: str | None = None) -> str:
    """Open a pull request on ``repo_id`` that merges ``new`` into its card; returns the PR's URL.

    Raises :class:`CardError` before any network use when huggingface_hub is offline, and with the cause when the Hub
    cannot be reached or refuses.
    """
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    require_online(repo_id)
    try:
        card = ModelCard.load(repo_id, token=token)
        merge(card, new, repo_id)
        url = card.push_to_hub(repo_id, token=token, create_pr=True,
                               commit_message=f"Add {METRIC_TYPE} eval results ({SOURCE_NAME})")
    except OfflineModeIsEnabled as err:
        raise CardError(f"cannot push to {repo_id!r}: the Hub is offline ({err}). Nothing was sent.") from None
    except (HfHubHTTPError, OSError) as err:
        raise CardError(
            f"could not open a pull request on {repo_id!r}: {type(err).__name__}: {err}. Check the repo id, your "
            "network, and that your token (`hf auth login` or --token) may write to it."
        ) from None
    return str(url)
