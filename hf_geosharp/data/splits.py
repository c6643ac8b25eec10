"""One split of a Hub dataset or of local files, its columns found by their usual names, and the deterministic
choice of examples."""

from __future__ import annotations

import codecs
import logging
from pathlib import Path
from typing import Any

from .spec import Columns, DataError, DataSpec, not_found, require_existing_path

logger = logging.getLogger(__name__)

TEXT_COLUMNS = ("text", "sentence", "sentence1", "premise", "question", "question1", "content", "document", "review")
PAIR_COLUMNS = {"sentence1": "sentence2", "premise": "hypothesis", "question1": "question2", "question": "sentence"}
LABEL_COLUMNS = ("label", "labels", "class", "target", "category")
IMAGE_COLUMNS = ("image", "img")
FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
DATA_FILE_SUFFIXES = (*FILE_BUILDERS, ".txt", ".arrow", ".zip", ".gz")  # a file path, never a Hub dataset name
SCRIPT_FIX = (
    "datasets no longer runs dataset loading scripts (and hf_geosharp runs no code it was not asked to); convert the "
    "data to files (csv, json, jsonl or parquet, or a folder saved with save_to_disk()) and pass those"
)


def _loading_script(path: Path) -> Path | None:
    """The loading script that ``datasets.load_dataset`` would find for the local ``path`` (``DIR/DIR.py``, or a
    ``.py`` file itself), or ``None``."""
    if path.suffix == ".py" and path.is_file():
        return path
    script = path / f"{path.resolve().name}.py"
    return script if path.is_dir() and script.is_file() else None


def check_source(spec: DataSpec) -> None:
    """Refuse, before anything is loaded, a local dataset path that does not exist (no Hub lookup for it) or that
    holds a loading script.

    Args:
        spec: the data's description (:class:`DataSpec`: dataset, split, columns, examples, batch size).
    """
    require_existing_path("the dataset", spec.dataset, DATA_FILE_SUFFIXES)
    path = Path(spec.dataset)
    script = _loading_script(path) if path.exists() else None
    if script is not None:
        raise DataError(f"the dataset {spec.dataset!r} is a loading script ({script.name}): {SCRIPT_FIX}.")


def load_split(spec: DataSpec) -> Any:
    """One split of a local or Hub dataset, as a ``datasets.Dataset``.

    Args:
        spec: the data's description (:class:`DataSpec`: dataset, split, columns, examples, batch size).

    Returns:
        The split, a ``datasets.Dataset``.
    """
    import datasets  # lazy here and below: importing datasets costs ~0.4 s, paid only by the steps that read one

    check_source(spec)
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
            raise not_found("dataset", spec.dataset, err) from None
        except RuntimeError as err:  # a Hub repo that holds a loading script
            if "scripts are no longer supported" not in str(err):
                raise
            raise DataError(f"the Hub dataset {spec.dataset!r} is a loading script: {SCRIPT_FIX}.") from None
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
    """Find (or check) the columns to read; named columns must exist, missing ones are looked for by usual names.

    Args:
        ds: the split.
        spec: the data's description (:class:`DataSpec`: dataset, split, columns, examples, batch size).
        vision: whether the model takes images (an image column is looked for instead of a text one).
        need_labels: whether a label column must be found (the model's own loss needs it).

    Returns:
        The columns to read.
    """
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
    if text is None and spec.text_column is None and "input_ids" in ds.column_names:
        return Columns(label=label, tokens="input_ids")  # already tokenised (e.g. the language-model zoo's blocks)
    if text is None:
        raise DataError(f"found no text column among {ds.column_names}; name it with --text-column.")
    partner = PAIR_COLUMNS.get(text)
    pair = _pick(ds, "--text-pair-column", spec.text_pair_column, (partner,) if partner else (), is_string)
    return Columns(text=text, text_pair=pair, label=label)


def select_examples(ds: Any, spec: DataSpec) -> Any:
    """The first ``n_examples`` rows after a seeded shuffle (or in file order): the same every time. ``n_examples``
    is a cap: a smaller split is used whole, with a warning.

    Args:
        ds: the split.
        spec: the data's description (:class:`DataSpec`: dataset, split, columns, examples, batch size).

    Returns:
        The selected rows, a ``datasets.Dataset``.
    """
    n = len(ds) if spec.n_examples is None else spec.n_examples
    if n > len(ds):  # a cap, like lm-evaluation-harness's --limit
        logger.warning("--n-examples %d but split %r of %r has %d rows; using all %d.", n, spec.split, spec.dataset,
                       len(ds), len(ds))  # fmt: skip
        n = len(ds)
    # in memory: on a dataset loaded from disk, datasets would otherwise write cache-*.arrow index files into the
    # user's data folder
    if spec.shuffle:
        ds = ds.shuffle(seed=spec.seed, keep_in_memory=True)
    return ds.select(range(n), keep_in_memory=True)
