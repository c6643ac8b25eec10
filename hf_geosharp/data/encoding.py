"""Encoding the chosen examples: token ids (with seeded masking for masked LMs), pixel arrays, and class ids the
model's head understands."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from .spec import Columns, DataError, DataSpec, Task

IGNORE_INDEX = -100  # transformers' cross-entropy skips this label
MLM_PROBABILITY = 0.15


def _encode_labels(values: list[Any], feature: Any, config: Any, column: str) -> list[Any]:
    """Class ids the model's head understands, from class ids, bools, or class names.

    Names (strings, or ClassLabel ids whose names the model knows) are matched to ``config.label2id`` ignoring case:
    datasets and models often order the same classes differently (MNLI is the classic case).
    """
    import datasets  # lazy: importing datasets costs ~0.4 s, paid only when labels are encoded

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


def _pretokenised(ds: Any, task: Task) -> dict[str, list]:
    """The rows of a dataset saved already tokenised: its ``input_ids`` and the model inputs beside them; a language
    model's ``labels`` column when it has one (else a causal LM predicts its inputs)."""
    keys = ["input_ids", "attention_mask", "token_type_ids"] + (["labels"] if task != "classification" else [])
    out = {k: list(ds[k]) for k in keys if k in ds.column_names}
    if task == "masked-lm" and "labels" not in out:
        raise DataError("this masked-LM model needs a 'labels' column beside the tokenised 'input_ids' (the masked "
                        "positions' ids, -100 elsewhere), or a text column to mask itself.")
    return out


def encode(
    ds: Any, columns: Columns, model: torch.nn.Module, processor: Any, spec: DataSpec, task: Task
) -> dict[str, list]:
    """Per-example model inputs (unpadded token lists, or pixel arrays) and labels, column by column.

    Args:
        ds: the selected split (a ``datasets.Dataset``).
        columns: which of its columns hold the inputs and the labels (:func:`resolve_columns`).
        model: the model the inputs are for.
        processor: its tokenizer (texts) or image processor (images).
        spec: the data's description (:class:`DataSpec`: dataset, split, columns, examples, batch size).
        task: what the model's loss measures (:func:`task_of`); it decides the labels' encoding.

    Returns:
        Input name -> per-example values (token lists, pixel arrays, labels), as :func:`make_batches` takes them.
    """
    if columns.image is not None:
        mode = "L" if getattr(model.config, "num_channels", 3) == 1 else "RGB"
        images = [img.convert(mode) for img in list(ds[columns.image])]
        out: dict[str, list] = {"pixel_values": list(processor(images=images, return_tensors="np")["pixel_values"])}
    elif columns.tokens is not None:
        out = _pretokenised(ds, task)
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
