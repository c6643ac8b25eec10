"""Publishing results the way the Hub reads them: ``model-index`` entries and ``.eval_results/*.yaml`` entries.

Two formats, both written with huggingface_hub's own classes (never hand-written YAML):

* ``model-index`` (legacy, in the card's front matter; :class:`huggingface_hub.EvalResult`). Hub leaderboards group
  results by (task type, dataset type, dataset config, dataset split, metric type), so every measure has its own
  metric type, its public key from :mod:`hf_geosharp.measures` (``geodesic_sharpness_inv``, ``adaptive_sharpness``,
  ...), and its settings (rho, steps, seed, stderr, ...) go into the metric's ``config``/``args``. A result whose
  configuration matches an existing entry replaces it, so rerunning a measurement updates the card.
* ``.eval_results/<benchmark>.yaml`` (the Hub's current format; :class:`huggingface_hub.EvalResultEntry`). Each entry
  points at a benchmark dataset on the Hub that carries an ``eval.yaml`` (template:
  ``hf_geosharp/hub/templates/eval.yaml``); the task id is the measure key, the settings and stderr go into ``notes``.

Every worst-case value carries its certificate (:func:`hf_geosharp.engine.result.certified`): ``certified: true`` or
``false`` in the model-index metric's ``args`` (kept by huggingface_hub's parser), the words "not certified: a lower
bound of the maximum" in its display name, and the certificate in the ``.eval_results`` entry's ``notes``. The
average case and relative flatness have no certificate (they maximise nothing): no ``certified`` field, and the
notes say so.

Honesty rules: the dataset is a Hub id (with config, split and revision) only when it came from the Hub; local data is
written as ``type: local:<name>``, which is not a Hub id (the format requires a ``type``). ``source`` is written only
when there is a real URL (``--source-url``, or a homepage in the package metadata). ``library_name``/``base_model``/
``license`` come from the model's existing card, its ``config.json`` or the user, never from a guess. No NaN is
written. Pushing lives in :mod:`hf_geosharp.hub.publish`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

if TYPE_CHECKING:
    from huggingface_hub import EvalResultEntry

from .._version import __version__
from ..durable import atomic_path, write_text
from ..engine.result import certificate_words, certified
from ..engine.settings import config_keys
from ..measures import MEASURES, Settings, key_of_engine_name
from .provenance import noted

logger = logging.getLogger(__name__)

SOURCE_NAME = f"hf_geosharp {__version__}"
EVAL_RESULTS_DIR = ".eval_results"
TEMPLATE_DIR = Path(__file__).with_name("templates")
_TASKS = {  # transformers head class suffix -> Hub task type (first match wins: longer suffixes first)
    "ForZeroShotImageClassification": "zero-shot-image-classification",
    "ForImageClassification": "image-classification",
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForMultipleChoice": "multiple-choice",
    "ForCausalLM": "text-generation",
    "LMHeadModel": "text-generation",
    "ForMaskedLM": "fill-mask",
    "ForConditionalGeneration": "text2text-generation",
    "ForSeq2SeqLM": "text2text-generation",
    "ForAudioClassification": "audio-classification",
    "ForCTC": "automatic-speech-recognition",
    "ForSpeechSeq2Seq": "automatic-speech-recognition",
    "ForObjectDetection": "object-detection",
    "ForSemanticSegmentation": "image-segmentation",
    "ForImageSegmentation": "image-segmentation",
    "ForVideoClassification": "video-classification",
}
#: What a result's config records that determines the number; copied into the metric's args when present.
#: The settings of a result a card shows: the shared ones first (:class:`~hf_geosharp.measures.Settings`, the
#: adaptive solver as ``variant``), then the engine's other settings (:func:`config_keys`) and what a run adds
#: (``n_batches``; relative flatness's ``layer``); not the solver's budget and tolerance (``tol``, ``max_steps``) nor
#: the metric, which the metric type names.
_NOT_SHOWN = ("tol", "max_steps", "metric")
_SETTINGS = tuple(dict.fromkeys(
    [*("variant" if f.name == "adaptive_variant" else f.name for f in dataclasses.fields(Settings)),
     *(k for k in config_keys() if k not in _NOT_SHOWN), "n_batches", "layer"]))
_DATA_ARGS = ("n_examples", "batch_size", "seed")
_LOCAL_SUFFIXES = {".csv", ".tsv", ".json", ".jsonl", ".parquet", ".arrow", ".txt"}
#: What a new card says of the geodesic ball, so that two published numbers can be compared.
BALL_NOTE = ("Geodesic sharpness depends on its radius convention, the `ball` argument of each entry: `calibrated` "
             "weighs each attention pair's metric so that scaling the pair's weights by 1 + t has the norm adaptive "
             "sharpness gives it (inv), or so that its ball lies inside inv's (mix); `paper` is the "
             "paper's unweighted metric (hf_geosharp 0.6.0 and earlier). Compare numbers only at equal rho and ball.")
#: The first huggingface_hub release with the ``.eval_results`` classes (imported only where they are used).
EVAL_RESULTS_HUB = "1.4.0"


class CardError(ValueError):
    """A card cannot be written or pushed; the message says what to change."""


@dataclass
class DatasetInfo:
    """Which data a result was measured on.

    ``name`` is a Hub dataset id when ``local`` is false, else a display name of local data (a file name, "digits").
    """

    name: str
    split: str
    config: str | None = None
    revision: str | None = None
    local: bool = False
    args: dict[str, Any] | None = None

    @property
    def type(self) -> str:
        """The model-index ``dataset.type``: the Hub id, or ``local:<name>`` (a colon is never part of a Hub id)."""
        return f"local:{self.name}" if self.local else self.name

    def describe(self) -> str:
        """Where the numbers were measured, in one line (dataset, config, split, examples)."""
        where = f"{self.name} (local)" if self.local else self.name + (f"/{self.config}" if self.config else "")
        return f"{where}, split {self.split}" + (f", {self.args['n_examples']} examples" if self.args and
                                                  self.args.get("n_examples") else "")


# ------------------------------------------------------------------------------------------------ what was measured
def key_of_result(result: dict[str, Any]) -> str:
    """The public key (:data:`hf_geosharp.measures.MEASURES`) of a ``SharpnessResult.to_dict()``."""
    key = key_of_engine_name(result["measure"])
    if key is None:
        raise CardError(f"result {result['measure']!r} is not one of the known measures ({', '.join(MEASURES)}).")
    return key


def known_task(model_class: str | None) -> str | None:
    """The Hub task of a transformers head class (``ViTForImageClassification`` -> ``image-classification``)."""
    for suffix, task in _TASKS.items():
        if model_class and model_class.endswith(suffix):
            return task
    return None


def task_type(model_class: str | None) -> str:
    """:func:`known_task`, or ``"other"`` with a warning that names the fix (``--task-type``)."""
    task = known_task(model_class)
    if task is None:
        logger.warning("no Hub task type is known for model class %r; writing task type 'other' (pass --task-type "
                       "to name it)", model_class)
    return task or "other"


def source_url(explicit: str | None = None) -> str | None:
    """Where this run can be seen: the URL the user passed, else the package's homepage if its metadata has one."""
    if explicit:
        return explicit
    try:
        urls = metadata.metadata("hf_geosharp").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    for label, _, url in (u.partition(", ") for u in urls):
        if label.strip().lower() in {"homepage", "home", "source", "repository"}:
            return url.strip()
    return None


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def _value(result: dict[str, Any], key: str) -> float:
    value = result.get("value")
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CardError(f"{key} ({result.get('measure')}) has no finite value ({value!r}); nothing is written. "
                        "Rerun the measurement (see the run's warnings) before publishing it.")
    return float(value)


def settings_args(result: dict[str, Any]) -> dict[str, Any]:
    """The settings the result's config records (plus its stderr when finite, and ``certified`` for a worst case):
    the metric's args."""
    config = result.get("config") or {}
    args = {k: config[k] for k in _SETTINGS if config.get(k) is not None and _finite(config[k])}
    key = key_of_engine_name(result.get("measure", ""))
    if "ball" not in args and key and MEASURES[key].family == "geodesic":
        args["ball"] = "paper"  # recorded before the radius convention existed: the paper's unweighted metrics
    budget = "steps" if args.get("mode") == "worst" else "n_samples"  # the solver effort that matters in this mode
    args.pop("n_samples" if budget == "steps" else "steps", None)
    stderr = result.get("stderr")
    if isinstance(stderr, (int, float)) and math.isfinite(stderr):
        args["stderr"] = float(stderr)
    if (flag := certified(result)) is not None:
        args["certified"] = flag
    return args


# ------------------------------------------------------------------------------------------------ model-index
def eval_result(result: dict[str, Any], dataset: DatasetInfo, task: str, *, url: str | None = None,
                extra_args: dict[str, Any] | None = None) -> EvalResult:
    """One model-index entry from a ``SharpnessResult.to_dict()``: metric type = the measure's public key;
    ``extra_args`` (what the run adds, e.g. a fresh ``head``) join the metric's args."""
    key = key_of_result(result)
    args = {**settings_args(result), **(extra_args or {})}
    name = ", ".join([MEASURES[key].title, *([f"rho={args['rho']}"] if "rho" in args else []),
                      *([f"{args['ball']} ball"] if "ball" in args else []),
                      *([f"{args['mode']} case"] if "mode" in args else []),
                      *(["freshly initialised head"] if "head" in args else []),
                      *([certificate_words(False)] if args.get("certified") is False else [])])
    url = source_url(url)
    return EvalResult(
        task_type=task, dataset_type=dataset.type, dataset_name=dataset.name, dataset_config=dataset.config,
        dataset_split=dataset.split, dataset_revision=dataset.revision, dataset_args=dataset.args,
        metric_type=key, metric_name=name, metric_value=_value(result, key), metric_config=result["measure"],
        metric_args=args, source_name=SOURCE_NAME if url else None, source_url=url,
    )


def _same_config(a: EvalResult, b: EvalResult) -> bool:
    """Same measurement: everything but the value, the display name, the stderr, the certificate and the library that
    produced it (a certified rerun replaces a lower bound)."""
    ignore = {"metric_value", "metric_name", "source_name", "source_url", "verified", "verify_token", "metric_args"}
    strip = [{k: v for k, v in (r.metric_args or {}).items() if k not in ("stderr", "certified")} for r in (a, b)]
    return strip[0] == strip[1] and all(getattr(a, k) == getattr(b, k) for k in vars(a) if k not in ignore)


def merge(card: ModelCard, new: list[EvalResult], model_name: str, metadata: dict[str, Any] | None = None,
          note: str | None = None) -> ModelCard:
    """Add ``new`` to the card's eval results, replacing entries with the same configuration; all else is kept.

    ``metadata`` (``library_name``, ``base_model``, ``license``) fills only fields the card does not have yet;
    ``note`` (how the numbers were measured, :func:`~hf_geosharp.hub.provenance.run_note`) goes into the text's notes
    block, one line per entry (:func:`~hf_geosharp.hub.provenance.noted`)."""
    card.text = noted(card.text, new, note)
    kept = [old for old in (card.data.eval_results or []) if not any(_same_config(old, n) for n in new)]
    card.data.model_name = card.data.model_name or model_name
    card.data.eval_results = kept + new
    for key, value in (metadata or {}).items():
        if value and not card.data.get(key):
            card.data[key] = value
    return card


def card_yaml(new: list[EvalResult], model_name: str) -> str:
    """The ``model-index`` YAML of ``new`` alone: the snippet to paste into a card's front matter."""
    return ModelCardData(model_name=model_name, eval_results=new).to_yaml()


def read_card_text(path: str | Path) -> str:
    """A card file's text as huggingface_hub reads it (``RepoCard.load``, ``metadata_load``): UTF-8 with or without
    a byte-order mark, line endings kept (a CRLF card is written back with CRLF)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise CardError(f"{str(path)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
                        "save it as UTF-8. Nothing was written or pushed.") from None


def parse_card(text: str, where: str) -> ModelCard:
    """A card from its text (as :func:`read_card_text` gives it), or a :class:`CardError` naming ``where`` when its
    front matter cannot be read: invalid YAML, not a mapping, or a block that opens with ``---`` but that
    huggingface_hub does not read as front matter (merging would write a second one above it)."""
    from huggingface_hub.repocard import REGEX_YAML_BLOCK  # the pattern RepoCard itself matches

    try:
        card = ModelCard(text)
    except (ValueError, yaml.YAMLError) as err:
        raise CardError(f"{where} has front matter that cannot be read ({type(err).__name__}); fix it first. "
                        "Nothing was written or pushed.") from None
    if REGEX_YAML_BLOCK.search(text) is None and text.lstrip().startswith("---"):
        raise CardError(f"{where} starts with '---' but huggingface_hub does not read a front matter there (it needs a "
                        "line '---' before and after the YAML); fix it first. Nothing was written or pushed.")
    return card


def new_card(name: str) -> ModelCard:
    """An empty card for a model that has none, tagged ``hf_geosharp``."""
    return ModelCard(f"---\ntags:\n- hf_geosharp\n---\n\n# {name}\n\nSharpness measured with hf_geosharp.\n\n"
                     f"{BALL_NOTE}\n")


def readme_path(target: str | Path) -> Path:
    """The card of ``target``: a model folder's README.md (also of a new folder: a path without a suffix), or a
    README.md itself. Anything else is refused: writing a card into ``MODEL/config.json`` would stop the model from
    loading."""
    path = Path(target)
    if path.is_dir() or not (path.exists() or path.suffix):
        return path / "README.md"
    if path.name.lower() == "readme.md":
        return path
    raise CardError(f"{str(path)!r} is neither a model folder nor a README.md; pass the model folder (its README.md "
                    "is edited or created) or the README.md itself. Nothing was written.")


def model_metadata(model_dir: str | Path, *, base_model: str | None = None,
                   license: str | None = None) -> dict[str, Any]:
    """Card metadata that is known, not guessed: ``library_name`` from a transformers ``config.json``, and what the
    user passed."""
    out: dict[str, Any] = {"base_model": base_model, "license": license}
    config = Path(model_dir) / "config.json"
    try:
        if "transformers_version" in json.loads(config.read_text()):
            out["library_name"] = "transformers"
    except (OSError, ValueError):
        pass
    return {k: v for k, v in out.items() if v}


def write_card(target: str | Path, new: list[EvalResult], model_name: str | None = None,
               metadata: dict[str, Any] | None = None, note: str | None = None) -> Path:
    """Merge ``new`` (and ``note``, :func:`merge`) into ``target`` (a README.md, or a model folder holding one);
    create the card if needed."""
    path = readme_path(target)
    name = model_name or path.parent.name
    card = parse_card(read_card_text(path), str(path)) if path.exists() else new_card(name)
    merge(card, new, name, metadata, note)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        card.save(tmp)
    logger.debug("wrote %d eval result(s) into %s", len(new), path)
    return path


# ------------------------------------------------------------------------------------------------ .eval_results
def eval_results_api(name: str) -> Any:
    """``huggingface_hub.<name>`` of the ``.eval_results`` format, or a :class:`CardError` naming the release needed."""
    import huggingface_hub

    try:
        return getattr(huggingface_hub, name)
    except AttributeError:
        need = f"huggingface_hub>={EVAL_RESULTS_HUB}"
        raise CardError(f".eval_results files need {need} (installed: {huggingface_hub.__version__}): "
                        f"pip install -U '{need}'") from None


def eval_result_entry(result: dict[str, Any], dataset: DatasetInfo, benchmark: str, *, url: str | None = None,
                      benchmark_revision: str | None = None, note: str | None = None) -> EvalResultEntry:
    """One ``.eval_results`` entry: the benchmark dataset, the measure key as task id, the settings, the certificate
    and ``note`` (how it was measured) in ``notes``."""
    key = key_of_result(result)
    args = settings_args(result)
    notes = ", ".join(f"{k}={v}" for k, v in args.items() if k != "certified")
    url = source_url(url)
    return eval_results_api("EvalResultEntry")(
        dataset_id=benchmark, task_id=key, value=_value(result, key), dataset_revision=benchmark_revision,
        source_url=url, source_name=SOURCE_NAME if url else None,
        notes=f"{result['measure']} on {dataset.describe()}: {notes}; {certificate_words(certified(result))}"
              + (f"; {note}" if note else ""),
    )


def eval_results_file(benchmark: str) -> str:
    """Path of a benchmark's entries in the model repo: ``.eval_results/<owner>__<name>.yaml``."""
    return f"{EVAL_RESULTS_DIR}/{re.sub(r'[^A-Za-z0-9._-]+', '__', benchmark)}.yaml"


def merge_entries(old: list[EvalResultEntry], new: list[EvalResultEntry]) -> list[EvalResultEntry]:
    """One value per (benchmark, revision, task): a benchmark fixes the settings, so a rerun replaces the entry."""
    keys = {(n.dataset_id, n.dataset_revision, n.task_id) for n in new}
    return [o for o in old if (o.dataset_id, o.dataset_revision, o.task_id) not in keys] + new


def entries_yaml(entries: list[EvalResultEntry]) -> str:
    """The ``.eval_results`` YAML of ``entries``, as huggingface_hub writes it."""
    return yaml.safe_dump(eval_results_api("eval_result_entries_to_yaml")(entries), sort_keys=False, allow_unicode=True)


def read_entries(text: str) -> list[EvalResultEntry]:
    """Entries of an ``.eval_results`` file (``parse_eval_result_entries``); a broken file is an error, not lost."""
    parse = eval_results_api("parse_eval_result_entries")
    try:
        data = yaml.safe_load(text) or []
        return parse(data if isinstance(data, list) else [data])
    except (yaml.YAMLError, KeyError, TypeError, ValueError) as err:
        raise CardError(f"cannot read the existing eval results ({err}); fix or remove the file first.") from None


def write_eval_results(model_dir: str | Path, entries: list[EvalResultEntry]) -> list[Path]:
    """Merge ``entries`` into ``MODEL/.eval_results/<benchmark>.yaml`` (one file per benchmark)."""
    written = []
    for benchmark in dict.fromkeys(e.dataset_id for e in entries):
        path = Path(model_dir) / eval_results_file(benchmark)
        old = read_entries(path.read_text()) if path.exists() else []
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, entries_yaml(merge_entries(old, [e for e in entries if e.dataset_id == benchmark])))
        written.append(path)
    return written


# ------------------------------------------------------------------------------------------------ run files
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


def _is_local(dataset: str) -> bool:
    path = Path(dataset).expanduser()
    return path.exists() or dataset.startswith(("/", ".", "~")) or path.suffix.lower() in _LOCAL_SUFFIXES


def dataset_info(context: dict[str, Any], *, name: str | None = None, split: str | None = None,
                 revision: str | None = None, local: bool | None = None) -> DatasetInfo:
    """The dataset from a run's recorded data settings; the keywords override (``name`` is required without them).

    Local data (a path, or ``local=True``) keeps only its name; a Hub dataset keeps id, config, split and revision."""
    data = context.get("data") or {}
    dataset = name or data.get("dataset")
    if not dataset:
        raise CardError("the results do not say which dataset they were measured on; pass --dataset NAME.")
    is_local = _is_local(dataset) if local is None else local
    hub_id, _, config = ("", "", None) if is_local else dataset.partition(":")
    args = {k: data[k] for k in _DATA_ARGS if data.get(k) is not None}
    if data.get("n_examples_used") is not None:  # what was measured, not what was asked for
        args["n_examples"] = data["n_examples_used"]
    return DatasetInfo(
        name=Path(dataset).name if is_local else hub_id, split=split or data.get("split") or "train",
        config=None if is_local else (data.get("config") or config or None),
        revision=None if is_local else (revision or data.get("revision")), local=is_local, args=args or None,
    )
