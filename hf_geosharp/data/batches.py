"""Padded batches from encoded examples, the whole pipeline from model and data spec to batches, and the
``accelerate`` launcher for multi-process runs."""

from __future__ import annotations

import numbers
import os
from typing import Any

import numpy as np
import torch

from .encoding import IGNORE_INDEX, encode
from .models import is_vision, require_task
from .spec import DataError, DataSpec, Task
from .splits import load_split, resolve_columns, select_examples


def launch_accelerator() -> Any:
    """An ``accelerate.Accelerator`` for a multi-process launch (``accelerate launch``, ``torchrun``), else ``None``.

    Every process then builds the same batches and the engine shares them out. On a host without GPUs (or other
    accelerator devices) the Accelerator must be told ``cpu=True``, or it ignores torchrun's processes and runs alone.

    Returns:
        The ``Accelerator``, or ``None`` in a single process.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not torch.distributed.is_initialized():
        return None
    from accelerate import Accelerator  # lazy: only multi-process launches need it

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

    Args:
        columns: input name -> per-example values.
        batch_size: rows per batch (the last batch holds the remainder).
        pad_token_id: the id token rows are padded with (``None``: 0; the attention mask hides it).
        task: the model's task; for ``causal-lm`` missing labels are the input ids.

    Returns:
        The batches, dicts of tensors.
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
    to the model's device when it solves it).

    Args:
        model: the model the batches are for (its task, input kind and pad token).
        processor: its tokenizer or image processor.
        spec: the data's description (:class:`DataSpec`: dataset, split, columns, examples, batch size).

    Returns:
        The batches, dicts of CPU tensors.
    """
    task = require_task(model)
    ds = load_split(spec)
    columns = resolve_columns(ds, spec, vision=is_vision(model), need_labels=task == "classification")
    ds = select_examples(ds, spec)
    encoded = encode(ds, columns, model, processor, spec, task)
    pad_token_id = getattr(model.config, "pad_token_id", None)
    return make_batches(encoded, spec.batch_size, pad_token_id=pad_token_id, task=task)
