"""From a model id and a dataset name or path to the labelled batches the engine consumes.

The engine takes a list of dicts that ``model(**batch)`` accepts, labels included. The faces (CLI, evaluate module,
leaderboard) all need the same steps: load the model and its tokenizer or image processor, load one split of a Hub
dataset or of local files, find the text / text-pair / label / image columns, pick examples deterministically, encode
them and pad each batch to its own longest row. They live here so that every face builds identical batches.

Example selection: the first ``n_examples`` rows after ``Dataset.shuffle(seed=seed)`` (or the first ``n_examples`` in
file order with ``shuffle=False``). The same arguments always give the same batches, also across processes.

Every mistake a user can fix raises :class:`DataError`, whose message names the bad field and the fix; the CLI turns it
into exit code 2.
"""

from __future__ import annotations

import logging
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

logger = logging.getLogger(__name__)

Task = Literal["classification", "causal-lm", "masked-lm"]

TEXT_COLUMNS = ("text", "sentence", "sentence1", "premise", "question", "question1", "content", "document", "review")
PAIR_COLUMNS = {"sentence1": "sentence2", "premise": "hypothesis", "question1": "question2", "question": "sentence"}
LABEL_COLUMNS = ("label", "labels", "class", "target", "category")
IMAGE_COLUMNS = ("image", "img")
FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
IGNORE_INDEX = -100  # transformers' cross-entropy skips this label
MLM_PROBABILITY = 0.15


class DataError(ValueError):
    """A problem with the user's model or data that the user can fix (the CLI's exit code 2)."""


@dataclass
class DataSpec:
    """Which examples to measure on, and how to read them.

    Attributes:
        dataset: a Hub dataset name (``name`` or ``name:config``) or a local path: a csv/tsv/json/jsonl/parquet file,
            a folder saved with ``save_to_disk``, or a folder of such files or of images in class sub-folders.
        config: the Hub dataset's configuration (alternative to ``name:config``).
        split: the split to read.
        n_examples: how many examples to use (``None``: all of the split).
        batch_size: examples per batch; the last batch holds the remainder.
        seed: seed of the shuffle that picks the examples (and of the masked-LM masking).
        shuffle: ``False`` takes the first ``n_examples`` in file order.
        max_length: tokenizer truncation length.
        text_column, text_pair_column, label_column, image_column: column names; found automatically when ``None``.
    """

    dataset: str
    config: str | None = None
    split: str = "train"
    n_examples: int | None = 1024
    batch_size: int = 128
    seed: int = 0
    shuffle: bool = True
    max_length: int = 128
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    image_column: str | None = None

    def __post_init__(self) -> None:
        if self.n_examples is not None and self.n_examples < 1:
            raise DataError(f"n_examples must be at least 1 (got {self.n_examples}).")
        if self.batch_size < 1:
            raise DataError(f"batch_size must be at least 1 (got {self.batch_size}).")


@dataclass
class Columns:
    """The dataset columns that feed the model (``None``: not used)."""

    text: str | None = None
    text_pair: str | None = None
    label: str | None = None
    image: str | None = None


def hub_offline() -> bool:
    """Whether huggingface_hub runs offline (``HF_HUB_OFFLINE=1``), so that errors can say so."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _not_found(what: str, name: str, err: Exception) -> DataError:
    if hub_offline():
        return DataError(
            f"{what} {name!r} is not a local path and not in the local Hugging Face cache, and the Hub is offline "
            f"(HF_HUB_OFFLINE=1). Pass a local path, or unset HF_HUB_OFFLINE on a machine with network access."
        )
    return DataError(f"could not load {what} {name!r} from a local path or the Hugging Face Hub: {err}")


# ----------------------------------------------------------------------------------------------------------- models


def task_of(model: torch.nn.Module) -> Task | None:
    """What the model's own loss measures, read from its class (``None``: no supported head); it decides where the
    labels come from."""
    from transformers.models.auto import modeling_auto as auto

    def names(mapping: dict[str, Any]) -> set[str]:
        return {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}

    cls = type(model).__name__
    if cls in names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        return "causal-lm"
    if cls in names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        return "masked-lm"
    if cls in names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES) | names(
        auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    ):
        return "classification"
    return None


def require_task(model: torch.nn.Module) -> Task:
    """:func:`task_of`, for faces that can only use the model's own loss."""
    task = task_of(model)
    if task is None:
        raise DataError(
            f"{type(model).__name__} has no supported task head, so its outputs carry no loss to measure sharpness on. "
            "Save a model with a sequence- or image-classification, causal-LM or masked-LM head (e.g. "
            "BertForSequenceClassification), or call the Python API with loss_fn=."
        )
    return task


REMOTE_CODE_FIX = (
    "hf_geosharp runs it only when asked: read that code, then pass --trust-remote-code (command line) or "
    "trust_remote_code=True (Python)"
)
_AUTO_HEADS = (  # the auto classes a custom model's config.auto_map may name, with a task head
    "AutoModelForSequenceClassification", "AutoModelForImageClassification", "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
)


def _weights_error(model_id: str, err: Exception) -> DataError | None:
    """The fix for a weights file that cannot be read safely, or ``None`` for other errors."""
    import pickle

    from safetensors import SafetensorError

    if isinstance(err, SafetensorError):
        return DataError(
            f"a weights file of {model_id!r} is damaged (truncated, zeroed or not a safetensors file: {err}); "
            "save the model again with model.save_pretrained() or download it again."
        )
    if isinstance(err, pickle.UnpicklingError):
        return DataError(
            f"the pickle weights (.bin) of {model_id!r} hold more than tensors, and torch.load(weights_only=True) "
            "refuses to run the code they contain; hf_geosharp never unpickles code. If you trust the file, convert it "
            "to safetensors elsewhere (load it, then model.save_pretrained(folder)) and measure that folder."
        )
    return None


def _from_pretrained(loader: Any, model_id: str, what: str, fix: str, trust_remote_code: bool = False) -> Any:
    """``loader.from_pretrained(model_id, trust_remote_code=...)`` with an error that says what is missing and where
    (local, Hub, offline), and never transformers' interactive "run the custom code?" prompt (it appears only when
    ``trust_remote_code`` is left ``None``)."""
    try:
        return loader.from_pretrained(model_id, trust_remote_code=bool(trust_remote_code))
    except Exception as err:  # noqa: BLE001 - every loading failure becomes a DataError that names the fix
        damaged = _weights_error(model_id, err)
        if damaged is not None:
            raise damaged from None
        if isinstance(err, ValueError) and "trust_remote_code" in str(err):
            message = f"the {what} {model_id!r} ships its own Python code (auto_map); {REMOTE_CODE_FIX}."
            raise DataError(message) from None
        if not isinstance(err, (OSError, ValueError, KeyError)):  # KeyError: an unknown model_type in config.json
            raise
        if Path(model_id).exists():
            raise DataError(f"could not load the {what} from the folder {model_id!r}; {fix} ({err})") from None
        raise _not_found(what, model_id, err) from None


CODE_CONFIGS = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")


def _local_auto_map(model_id: str) -> dict[str, list[str]]:
    """``{file: auto classes}`` for each file of a local model folder whose ``auto_map`` names custom code."""
    import json

    found = {}
    for name in CODE_CONFIGS:
        try:
            config = json.loads((Path(model_id) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("auto_map"):
            found[name] = sorted(config["auto_map"])
    return found


def load_model(model_id: str, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """Load a model with the task head its config names (``config.architectures``), in eval mode.

    A folder whose config, tokenizer or processor files name custom code (``auto_map``) is refused before any of that
    code is imported, unless ``trust_remote_code=True``."""
    import transformers

    if not isinstance(model_id, (str, os.PathLike)):
        raise DataError(f"model_id must be a folder path or a Hub id (a string), got {type(model_id).__name__}.")
    model_id = str(model_id)
    custom = _local_auto_map(model_id)
    if custom and not trust_remote_code:
        where = "; ".join(f"{name}: {', '.join(classes)}" for name, classes in custom.items())
        raise DataError(f"the model folder {model_id!r} names custom Python code (auto_map in {where}); "
                        f"{REMOTE_CODE_FIX}.")
    save = "save it there with model.save_pretrained()"
    config = _from_pretrained(transformers.AutoConfig, model_id, "model", save, trust_remote_code)
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    auto_map = getattr(config, "auto_map", None) or {}
    if cls is None and trust_remote_code:  # a custom class: its auto_map says which auto class builds it
        cls = next((getattr(transformers, name) for name in _AUTO_HEADS if name in auto_map), None)
    if cls is None:
        raise DataError(
            f"model {model_id!r} does not name a transformers class in config.architectures ({config.architectures}); "
            "save it with model.save_pretrained() from a class with a task head."
        )
    return _from_pretrained(cls, model_id, "model", save, trust_remote_code).eval()


def is_vision(model: torch.nn.Module) -> bool:
    return getattr(model, "main_input_name", "input_ids") == "pixel_values"


def load_processor(model_id: str, model: torch.nn.Module, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer (text models) or image processor (vision models) saved with the model.

    A tokenizer without a pad token pads with its EOS token, and a model without ``config.pad_token_id`` gets that id
    (GPT-2-style classification heads find each row's last token by it).
    """
    import transformers

    if is_vision(model):
        fix = "save it next to the model with image_processor.save_pretrained()"
        return _from_pretrained(transformers.AutoImageProcessor, model_id, "image processor", fix, trust_remote_code)
    fix = "save it next to the model with tokenizer.save_pretrained()"
    tokenizer = _from_pretrained(transformers.AutoTokenizer, model_id, "tokenizer", fix, trust_remote_code)
    if tokenizer.pad_token is None:  # padding is masked out, so any token will do
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


# --------------------------------------------------------------------------------------------------------- datasets


def load_split(spec: DataSpec) -> Any:
    """One split of a local or Hub dataset, as a ``datasets.Dataset``."""
    import datasets

    path = Path(spec.dataset)
    if path.exists():
        if spec.config:
            raise DataError(f"--config {spec.config!r} only applies to Hub datasets, not to the local path {path}.")
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            try:
                loaded = datasets.load_from_disk(str(path))
            except (OSError, ValueError, KeyError) as err:  # missing or damaged arrow files, a bad state.json
                raise DataError(f"cannot read the saved dataset {str(path)!r} ({type(err).__name__}: {err}); save "
                                "it again with save_to_disk().") from None
        elif path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(
                    f"cannot read {path.name!r}: the dataset file must end in one of {sorted(FILE_BUILDERS)}."
                )
            if builder != "parquet":
                _require_utf8(path)
            kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
            try:
                loaded = datasets.load_dataset(builder, data_files=str(path), **kwargs)
            except datasets.exceptions.DatasetGenerationError as err:
                cause = err.__cause__ or err
                raise DataError(f"cannot read the {builder} file {str(path)!r}: {cause}; fix the file.") from None
        else:  # a folder of data files, or an imagefolder: datasets infers the format
            for file in path.rglob("*"):
                if file.suffix.lower() in (".csv", ".tsv", ".json", ".jsonl") and file.is_file():
                    _require_utf8(file)
            try:
                loaded = datasets.load_dataset(str(path))
            except datasets.exceptions.DatasetGenerationError as err:
                raise DataError(f"cannot read the data files in {str(path)!r}: {err.__cause__ or err}.") from None
    else:
        name, _, config = spec.dataset.partition(":")
        if config and spec.config and config != spec.config:
            raise DataError(f"dataset {spec.dataset!r} names config {config!r} but --config is {spec.config!r}.")
        try:  # only the split asked for: Hub datasets can be large
            return datasets.load_dataset(name, config or spec.config, split=spec.split)
        except OSError as err:
            raise _not_found("dataset", spec.dataset, err) from None
        except ValueError as err:  # an unknown split or config
            raise DataError(f"dataset {spec.dataset!r}: {err} Choose with --split / --config.") from None
    if isinstance(loaded, datasets.Dataset):  # load_from_disk of a single split
        return loaded
    if spec.split not in loaded:
        raise DataError(f"dataset {spec.dataset!r} has no split {spec.split!r}; its splits are {list(loaded)}. "
                        "Choose one with --split.")
    return loaded[spec.split]


def _require_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """Refuse a text data file that is not UTF-8, naming the line of the first bad byte (streamed, any size)."""
    import codecs

    decoder, line, offset = codecs.getincrementaldecoder("utf-8")(), 1, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                line += block[: err.start].count(b"\n")
                raise DataError(
                    f"{str(path)!r} is not UTF-8 text: byte 0x{block[err.start]:02x} at offset {offset + err.start} "
                    f"(line {line}) cannot be decoded. Save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)."
                ) from None
            line += block.count(b"\n")
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(f"{str(path)!r} is not UTF-8 text: it ends inside a multi-byte character.") from None


def _pick(ds: Any, flag: str, given: str | None, candidates: tuple[str, ...], accept: Any) -> str | None:
    if given is not None:
        if given not in ds.column_names:
            raise DataError(f"{flag} {given!r} is not a column of the dataset; its columns are {ds.column_names}.")
        return given
    return next((c for c in candidates if c in ds.column_names and accept(ds.features[c])), None)


def resolve_columns(ds: Any, spec: DataSpec, *, vision: bool, need_labels: bool) -> Columns:
    """Find (or check) the columns to read; named columns must exist, missing ones are looked for by usual names."""
    import datasets

    def is_string(f: Any) -> bool:
        return isinstance(f, datasets.Value) and f.dtype in ("string", "large_string")

    def is_label(f: Any) -> bool:
        return isinstance(f, (datasets.ClassLabel, datasets.Value))

    class_labels = tuple(c for c, f in ds.features.items() if isinstance(f, datasets.ClassLabel))
    label = _pick(ds, "--label-column", spec.label_column, class_labels + LABEL_COLUMNS, is_label)
    if label is None and need_labels:
        raise DataError(
            f"the dataset has no label column (looked for a ClassLabel column or one of {list(LABEL_COLUMNS)}; its "
            f"columns are {ds.column_names}). Name it with --label-column, or use a model whose loss needs no labels "
            "(causal or masked LM)."
        )
    if vision:
        images = tuple(c for c, f in ds.features.items() if isinstance(f, datasets.Image))
        image = _pick(ds, "--image-column", spec.image_column, images + IMAGE_COLUMNS, lambda f: True)
        if image is None:
            raise DataError(f"found no image column among {ds.column_names}; name it with --image-column.")
        return Columns(label=label, image=image)
    strings = tuple(c for c, f in ds.features.items() if is_string(f) and c != label)
    only_string = strings if len(strings) == 1 else ()
    text = _pick(ds, "--text-column", spec.text_column, TEXT_COLUMNS + only_string, is_string)
    if text is None:
        raise DataError(f"found no text column among {ds.column_names}; name it with --text-column.")
    partner = PAIR_COLUMNS.get(text)
    pair = _pick(ds, "--text-pair-column", spec.text_pair_column, (partner,) if partner else (), is_string)
    return Columns(text=text, text_pair=pair, label=label)


def select_examples(ds: Any, spec: DataSpec) -> Any:
    """The first ``n_examples`` rows after a seeded shuffle (or in file order): the same every time. ``n_examples``
    is a cap: a smaller split is used whole, with a warning."""
    n = len(ds) if spec.n_examples is None else spec.n_examples
    if n > len(ds):  # a cap, like lm-evaluation-harness's --limit
        logger.warning("--n-examples %d but split %r of %r has %d rows; using all %d.", n, spec.split, spec.dataset,
                       len(ds), len(ds))  # fmt: skip
        n = len(ds)
    if spec.shuffle:
        ds = ds.shuffle(seed=spec.seed)
    return ds.select(range(n))


def _encode_labels(values: list[Any], feature: Any, config: Any, column: str) -> list[Any]:
    """Class ids the model's head understands, from class ids, bools, or class names.

    Names (strings, or ClassLabel ids whose names the model knows) are matched to ``config.label2id`` ignoring case:
    datasets and models often order the same classes differently (MNLI is the classic case).
    """
    import datasets

    label2id = {str(k).lower(): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
    named = {k for k in label2id if not re.fullmatch(r"label_\d+", k)}  # transformers' placeholder names don't count
    if isinstance(feature, datasets.ClassLabel) and named and {n.lower() for n in feature.names} <= named:
        values = [feature.names[v] for v in values]
    if all(isinstance(v, str) for v in values):
        unknown = sorted({v for v in values if v.lower() not in label2id})
        if unknown:
            raise DataError(
                f"label column {column!r} holds names {unknown[:5]} that the model's config.label2id "
                f"({sorted(label2id)}) does not know; map them to class ids first."
            )
        return [label2id[v.lower()] for v in values]
    if all(isinstance(v, (bool, int, np.integer)) for v in values):
        ids = [int(v) for v in values]
        n_labels = getattr(config, "num_labels", None) or max(ids) + 1
        bad = sorted({v for v in ids if not 0 <= v < n_labels})
        if bad:
            raise DataError(
                f"label column {column!r} holds class ids {bad[:5]} outside the model's {n_labels} classes "
                f"(0..{n_labels - 1}); relabel the data or use a model with num_labels > {max(ids)}."
            )
        return ids
    if all(isinstance(v, float) for v in values) and getattr(config, "num_labels", None) == 1:
        return values  # a regression head
    raise DataError(f"label column {column!r} must hold class ids or class names; found {values[:3]}.")


def _mask_tokens(input_ids: list[list[int]], special: list[list[int]], tokenizer: Any, seed: int) -> dict[str, list]:
    """Seeded masked-LM corruption: 15% of the ordinary tokens (at least one per row) become [MASK]."""
    if tokenizer.mask_token_id is None:
        raise DataError("this masked-LM model's tokenizer has no mask token, so there is nothing to predict.")
    rng = np.random.default_rng(seed)
    masked, labels = [], []
    for ids, spec_mask in zip(input_ids, special):
        ordinary = np.flatnonzero(np.asarray(spec_mask) == 0)
        chosen = ordinary[rng.random(len(ordinary)) < MLM_PROBABILITY] if len(ordinary) else ordinary
        if len(ordinary) and not len(chosen):
            chosen = ordinary[rng.integers(len(ordinary))][None]
        row, lab = list(ids), [IGNORE_INDEX] * len(ids)
        for j in chosen:
            lab[j], row[j] = row[j], tokenizer.mask_token_id
        masked.append(row)
        labels.append(lab)
    return {"input_ids": masked, "labels": labels}


def encode(
    ds: Any, columns: Columns, model: torch.nn.Module, processor: Any, spec: DataSpec, task: Task
) -> dict[str, list]:
    """Per-example model inputs (unpadded token lists, or pixel arrays) and labels, column by column."""
    if columns.image is not None:
        mode = "L" if getattr(model.config, "num_channels", 3) == 1 else "RGB"
        images = [img.convert(mode) for img in list(ds[columns.image])]
        out: dict[str, list] = {"pixel_values": list(processor(images=images, return_tensors="np")["pixel_values"])}
    else:
        texts = list(ds[columns.text])
        pairs = list(ds[columns.text_pair]) if columns.text_pair else None
        for name, values in ((columns.text, texts), (columns.text_pair, pairs or [])):
            if any(not isinstance(v, str) for v in values):
                raise DataError(f"text column {name!r} has empty or non-text rows; drop or fill them first.")
        enc = processor(
            texts, pairs, truncation=True, max_length=spec.max_length, return_special_tokens_mask=task == "masked-lm"
        )
        out = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
        if task == "masked-lm":
            out.update(_mask_tokens(out["input_ids"], enc["special_tokens_mask"], processor, spec.seed))
    if task == "classification":  # language models take their labels from the text itself
        out["labels"] = _encode_labels(list(ds[columns.label]), ds.features[columns.label], model.config, columns.label)
    return out


# ---------------------------------------------------------------------------------------------------------- batches


def launch_accelerator() -> Any:
    """An ``accelerate.Accelerator`` for a multi-process launch (``accelerate launch``, ``torchrun``), else ``None``.

    Every process then builds the same batches and the engine shares them out. On a host without GPUs (or other
    accelerator devices) the Accelerator must be told ``cpu=True``, or it ignores torchrun's processes and runs alone.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not torch.distributed.is_initialized():
        return None
    from accelerate import Accelerator

    devices = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, XPU, ... alike
    has_device = devices.is_available() if devices is not None else torch.cuda.is_available()
    return Accelerator(cpu=not has_device)




def _check_row_lengths(columns: dict[str, list]) -> None:
    """Every per-token input row must have one entry per token of its ``input_ids`` row: padding a shorter
    ``attention_mask`` with zeros would silently drop the tokens it does not cover."""
    ids = columns.get("input_ids")
    if ids is None:
        return
    for key in ("attention_mask", "token_type_ids"):
        for j, (row, mask) in enumerate(zip(ids, columns.get(key) or [])):
            if len(mask) != len(row):
                raise DataError(
                    f"example {j}: {key} has {len(mask)} entries but input_ids has {len(row)}; pass one {key} entry "
                    "per token (the tokenizer returns matching rows), or leave attention_mask out to mask nothing."
                )


def make_batches(
    columns: dict[str, list], batch_size: int, *, pad_token_id: int | None, task: Task | None
) -> list[dict[str, torch.Tensor]]:
    """Consecutive batches of ``batch_size`` rows, each padded (right) to its own longest row.

    ``columns`` maps input names to per-example values: token lists of any length, pixel arrays, class ids or per-token
    label lists. A missing ``attention_mask`` is built from the row lengths; causal-LM labels default to the input ids
    with padding ignored (the model shifts them itself).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise DataError(f"batch_size must be a positive integer (examples per batch), got {batch_size!r}.")
    batch_size = int(batch_size)
    if not columns:
        raise DataError("no model inputs were given (expected input_ids or pixel_values).")
    lengths = {k: len(v) for k, v in columns.items()}
    if len(set(lengths.values())) != 1:
        raise DataError(f"inputs have different numbers of examples: {lengths}.")
    n = next(iter(lengths.values()))
    if n == 0:
        raise DataError("no examples were given.")
    _check_row_lengths(columns)
    pad = {"input_ids": 0 if pad_token_id is None else pad_token_id, "labels": IGNORE_INDEX}
    batches = []
    for start in range(0, n, batch_size):
        chunk = {k: v[start : start + batch_size] for k, v in columns.items()}
        batch: dict[str, torch.Tensor] = {}
        if "input_ids" in chunk and "attention_mask" not in chunk:
            chunk["attention_mask"] = [[1] * len(row) for row in chunk["input_ids"]]
        for key, rows in chunk.items():
            if key == "pixel_values":
                batch[key] = torch.as_tensor(np.asarray(rows, dtype=np.float32))
            elif key == "labels" and not isinstance(rows[0], (list, tuple, np.ndarray)):
                batch[key] = torch.as_tensor(rows)
            else:
                width = max(len(r) for r in rows)
                batch[key] = torch.tensor([list(r) + [pad.get(key, 0)] * (width - len(r)) for r in rows])
        if task == "causal-lm" and "labels" not in batch:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        batches.append(batch)
    return batches


def load_batches(model: torch.nn.Module, processor: Any, spec: DataSpec) -> list[dict[str, torch.Tensor]]:
    """All of the above: the batches ``model(**batch)`` turns into its loss (on the CPU; the engine moves each batch
    to the model's device when it solves it)."""
    task = require_task(model)
    ds = load_split(spec)
    columns = resolve_columns(ds, spec, vision=is_vision(model), need_labels=task == "classification")
    ds = select_examples(ds, spec)
    encoded = encode(ds, columns, model, processor, spec, task)
    pad_token_id = getattr(model.config, "pad_token_id", None)
    return make_batches(encoded, spec.batch_size, pad_token_id=pad_token_id, task=task)
