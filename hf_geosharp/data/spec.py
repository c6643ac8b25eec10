"""The vocabulary every data step shares: what to read (:class:`DataSpec`), which columns feed the model
(:class:`Columns`), the task of a model, and :class:`DataError`, the error a user can fix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from huggingface_hub import constants

Task = Literal["classification", "causal-lm", "masked-lm"]


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
    tokens: str | None = None  # ``input_ids`` of a dataset saved already tokenised (its other model inputs beside it)


def hub_offline() -> bool:
    """Whether huggingface_hub runs offline (``HF_HUB_OFFLINE=1``), so that errors can say so.

    Returns:
        ``True`` when ``HF_HUB_OFFLINE`` is set to a true value.
    """
    return bool(constants.HF_HUB_OFFLINE)


def not_found(what: str, name: str, err: Exception) -> DataError:
    """The error for a model or dataset that is neither a local path nor reachable on the Hub (offline said so)."""
    if hub_offline():
        return DataError(
            f"{what} {name!r} is not a local path and not in the local Hugging Face cache, and the Hub is offline "
            f"(HF_HUB_OFFLINE=1). Pass a local path, or unset HF_HUB_OFFLINE on a machine with network access."
        )
    return DataError(f"could not load {what} {name!r} from a local path or the Hugging Face Hub: {err}")


def _looks_local(name: str, extensions: tuple[str, ...]) -> bool:
    """Whether ``name`` can only mean a local path, never a Hub id (``name`` or ``org/name``): it starts with ``./``,
    ``../``, ``/`` or ``~``, has more than one ``/``, holds the OS's own separator (Windows), or ends in one of
    ``extensions`` (a file type such as ``.csv``)."""
    return (
        name.startswith(("./", "../", "~", ".\\", "..\\")) or os.path.isabs(name) or name.count("/") > 1
        or name.endswith(("/", os.sep)) or (os.sep != "/" and os.sep in name) or name.lower().endswith(extensions)
    )


def require_existing_path(what: str, name: str, extensions: tuple[str, ...] = ()) -> None:
    """Refuse at once a ``name`` that can only be a local path and does not exist, before any Hub lookup (which would
    answer with an id-format error, or retry for half a minute before saying it cannot reach the Hub).

    Args:
        what: what ``name`` was given as, as the message names it (e.g. ``--dataset``).
        name: the path or Hub id given.
        extensions: file endings that make ``name`` a local path (e.g. ``.csv``), besides path separators.
    """
    if not _looks_local(name, extensions) or Path(name).exists():
        return
    expanded = Path(name).expanduser()
    if expanded != Path(name) and expanded.exists():
        raise DataError(f"{what} {name!r}: '~' is not expanded here (it was quoted); pass {str(expanded)!r}.")
    raise DataError(f"{what} {name!r} does not exist (no such file or folder here); check the path. A Hub id "
                    "looks like 'name' or 'org/name'.")
