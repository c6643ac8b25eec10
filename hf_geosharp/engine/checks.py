"""Checks that run before any work: models and batches that would otherwise fail deep inside a model or a loss
(or, on a GPU, as a device-side assert that poisons the CUDA context). The settings check themselves
(:class:`hf_geosharp.engine.settings.RunSettings`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from torch import Tensor, nn

_CLASSIFIER_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForImageClassification")
_PER_EXAMPLE_HEADS = ("ForSequenceClassification", "ForImageClassification")  # one prediction per example
_TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")


def check_model(model: nn.Module) -> None:
    """Refuse a model whose weights or buffers were made inside ``torch.inference_mode()`` (inference tensors):
    autograd cannot differentiate through them, and they cannot be written back in place afterwards, so the
    measurement would run to the end and then fail to restore the model. Also buffers no forward can use: on the meta
    device (no data: a lookup in them fails as a bare "index out of range in self") or holding NaN (e.g. a BatchNorm
    running variance from a diverged training run, which makes every loss NaN). Checked before anything touches it."""
    check_buffers(model)
    inference = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
                 if t.is_inference()]
    if inference:
        shown = ", ".join(inference[:3]) + (f" and {len(inference) - 3} more" if len(inference) > 3 else "")
        raise ValueError(
            f"The model's tensors were made inside torch.inference_mode() ({shown}), and autograd cannot use such "
            "inference tensors; build or load the model outside torch.inference_mode() (torch.no_grad() is fine), "
            "or pass a copy made outside it (copy.deepcopy(model))."
        )


def check_buffers(model: nn.Module) -> None:
    """Refuse buffers on the meta device and floating-point buffers holding NaN (inf is left alone: masks hold it)."""
    for name, buffer in model.named_buffers():
        if buffer.is_meta:
            raise ValueError(
                f"The model's buffer {name!r} is on the meta device (no data), so the forward cannot use it; the model "
                "was not fully loaded (a buffer the checkpoint does not hold, left empty by device_map='meta' or "
                "init_empty_weights). Load the model again without them, or fill the buffer (e.g. "
                "model.to_empty(device='cpu') and load a state dict that holds it)."
            )
        local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
        if local.is_floating_point() and local.numel() and bool(local.detach().isnan().any()):
            raise ValueError(
                f"The model's buffer {name!r} holds NaN (e.g. BatchNorm running statistics from a diverged training "
                "run), so every loss would be NaN whatever the inputs; recompute it on data or reset it "
                "(BatchNorm: module.reset_running_stats()), or fix the checkpoint."
            )


#: What turns rows into batches, named in every error about rows that were not batched.
BATCHING_FIX = (
    "batch the rows into tensors first: list(dataset.with_format('torch').iter(batch_size=8)) for rows of equal "
    "length, or torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=transformers.DataCollatorWithPadding("
    "tokenizer)) to pad them; keep only the model's inputs and labels (dataset.remove_columns([...]))"
)


def check_not_rows(batches: Any) -> None:
    """Refuse a ``datasets`` dataset passed as the batches: it iterates over single rows (lists of token ids, an int
    label), which a model's forward fails on deep inside (``'list' object has no attribute 'size'``)."""
    module = type(batches).__module__.split(".")[0]
    if module == "datasets" and hasattr(batches, "column_names"):
        raise TypeError(
            f"batches is a datasets.{type(batches).__name__}, whose items are single rows, not batches; "
            f"{BATCHING_FIX}."
        )


def _is_transformers_model(model: nn.Module) -> bool:
    return getattr(model, "config", None) is not None and callable(getattr(model, "get_input_embeddings", None))


#: What turns batches of arrays (numpy, pandas, Python numbers) into the tensors a model takes.
TENSOR_FIX = (
    "the model takes torch tensors: batch a datasets.Dataset with dataset.with_format('torch') (e.g. "
    "list(dataset.with_format('torch').iter(batch_size=8))), or convert each value with torch.as_tensor(value)"
)


def _data_not_tensor(value: Any) -> bool:
    """An array-like that is not a torch tensor: a numpy array or scalar, a pandas object, anything with
    ``__array__``, or a list or tuple of numbers (a tuple of tensors, a legacy cache, passes)."""
    if isinstance(value, Tensor) or value is None or isinstance(value, (bool, str)):
        return False
    if hasattr(value, "__array__") or isinstance(value, np.generic):
        return True
    if isinstance(value, (list, tuple)) and value:
        first = value[0]
        return isinstance(first, (int, float, list, np.generic)) or (
            hasattr(first, "__array__") and not isinstance(first, Tensor))
    return False


def check_collated(model: nn.Module, batch: Mapping, i: int) -> None:
    """A transformers model takes ``[batch, ...]`` tensors: a model input or the labels given as a list (rows, or a
    DataLoader's default collate of rows that hold lists) or as one example's 1-D token ids fails inside its forward
    (``'list' object has no attribute 'size'``, an unpacking error); one given as a numpy array (a dataset in the
    ``numpy`` format), a numpy scalar or a Python number fails there too (``'int' object is not callable``). Refused,
    not converted: the batch the model is measured on is the batch the caller's ``model(**batch)`` gets."""
    if not _is_transformers_model(model):  # a loss_fn may take any batch
        return
    tensor_keys = (*_TOKEN_INPUTS, "pixel_values", "labels", "label")
    for key in tensor_keys:
        value = batch.get(key)
        if isinstance(value, (list, tuple)):
            raise ValueError(
                f"Batch {i} is not collated: {key!r} is a {type(value).__name__} of {len(value)} items, not a tensor "
                "(single rows, or rows a DataLoader grouped without a collate_fn for them); "
                f"{BATCHING_FIX}."
            )
    for key, value in batch.items():
        if _data_not_tensor(value) or (key in tensor_keys and not isinstance(value, Tensor) and value is not None):
            package = type(value).__module__.split(".")[0]
            kind = type(value).__qualname__ if package == "builtins" else f"{package}.{type(value).__qualname__}"
            raise TypeError(f"Batch {i}: {key!r} is a {kind}, not a torch tensor; {TENSOR_FIX}.")
    ids = batch.get("input_ids")
    if isinstance(ids, Tensor) and ids.dim() == 1:
        raise ValueError(
            f"Batch {i} is one example: its input_ids have shape {list(ids.shape)}, and the model takes [batch, "
            f"sequence]; {BATCHING_FIX}."
        )


def check_batch(model: nn.Module, batch: Any, i: int) -> None:
    """Refuse, before any work, the batches that would otherwise fail deep inside the model or the loss.

    Rows that were not batched (:func:`check_collated`); empty batches; rows that disagree in number (dimension 0;
    size 1 may broadcast); class labels outside the classifier's range, which cross-entropy reports as a bare index
    error on the CPU and as a device-side assert, that poisons the CUDA context, on a GPU."""
    if not isinstance(batch, Mapping):
        return
    check_collated(model, batch, i)
    tensors = {k: v for k, v in batch.items() if isinstance(v, Tensor)}
    if not batch or any(v.numel() == 0 for v in tensors.values()):
        raise ValueError(f"Batch {i} is empty; drop it or check the data pipeline.")
    rows = {k: v.shape[0] for k, v in tensors.items() if v.dim() > 0 and v.shape[0] != 1}
    if len(set(rows.values())) > 1:
        raise ValueError(f"Batch {i} is ragged: its tensors disagree on the number of examples (dimension 0): {rows}.")
    lengths = {k: tensors[k].shape[1] for k in _TOKEN_INPUTS if k in tensors and tensors[k].dim() > 1}
    if len(set(lengths.values())) > 1:  # some models broadcast a short mask silently
        raise ValueError(f"Batch {i} is ragged: its token inputs disagree on the sequence length: {lengths}.")
    inference = [k for k, v in tensors.items() if v.is_inference()]
    if inference:
        raise ValueError(
            f"Batch {i} holds tensors made inside torch.inference_mode() ({', '.join(inference)}), which autograd "
            "cannot use; build the batches outside it, or pass clones made outside it (t.clone())."
        )
    check_tokens(model, tensors, i)
    labels, config = tensors.get("labels"), getattr(model, "config", None)
    n_labels = getattr(config, "num_labels", None)
    check_labels_per_example(model, labels, n_labels, i)
    if (
        labels is not None and labels.is_floating_point() and labels.dim() == 1 and isinstance(n_labels, int)
        and n_labels >= 2 and getattr(config, "problem_type", None) is None
        and type(model).__name__.endswith(_CLASSIFIER_HEADS)
    ):
        raise ValueError(
            f"Batch {i} has float labels ({labels.dtype}) for a classifier with {n_labels} classes; pass class ids "
            "as integers (labels.long()), or for multi-label targets a float tensor of shape [batch, num_labels] "
            "with config.problem_type='multi_label_classification'."
        )
    if (
        labels is not None and not labels.is_floating_point() and n_labels == 1
        and type(model).__name__.endswith(_CLASSIFIER_HEADS) and getattr(config, "problem_type", None) is None
    ):
        raise ValueError(
            f"Batch {i} has integer labels for a model with one output (num_labels=1, a regression head); pass the "
            "targets as floats (labels.float()), or load the model with num_labels set to the number of classes."
        )
    if (
        labels is None or labels.is_floating_point() or not isinstance(n_labels, int) or n_labels < 2
        or getattr(config, "problem_type", None) in ("regression", "multi_label_classification")
        or not type(model).__name__.endswith(_CLASSIFIER_HEADS)
    ):
        return
    real = labels[labels != -100]  # -100: positions the loss ignores
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= n_labels):
        bad = int(real.max()) if int(real.max()) >= n_labels else int(real.min())
        raise ValueError(
            f"Batch {i} has label {bad}, but the model has {n_labels} classes (config.num_labels); labels must be in "
            f"0..{n_labels - 1} (or -100 to ignore a position)."
        )


def check_labels_per_example(model: nn.Module, labels: Tensor | None, n_labels: Any, i: int) -> None:
    """A head that predicts once per example (sequence or image classification) takes one label per example, or
    for float targets (multi-label, multi-output regression) ``num_labels`` of them; one label per token would fail
    inside the loss as a bare batch-size mismatch (or, for a regression head, broadcast into a wrong number)."""
    if labels is None or labels.dim() < 2 or not type(model).__name__.endswith(_PER_EXAMPLE_HEADS):
        return
    per_example = labels[0].numel()
    if per_example == 1 or (labels.is_floating_point() and labels.dim() == 2 and per_example == n_labels):
        return
    shape = list(labels.shape)
    raise ValueError(
        f"Batch {i} has {per_example} labels per example (labels of shape {shape}), but {type(model).__name__} "
        f"predicts one class per example; pass one label per example (shape [{shape[0]}]), or for one label per "
        "token use a model with a token-classification head (e.g. AutoModelForTokenClassification)."
    )


def embedding_rows(model: nn.Module, suffix: str) -> tuple[str, int] | None:
    """The first ``nn.Embedding`` whose name ends in ``suffix``, and how many rows (ids or positions) it can look up
    (RoBERTa-style position tables reserve ``padding_idx + 1`` rows)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.endswith(suffix):
            reserved = module.padding_idx + 1 if suffix == "position_embeddings" and module.padding_idx else 0
            return name, module.num_embeddings - reserved
    return None


def check_tokens(model: nn.Module, tensors: Mapping[str, Tensor], i: int) -> None:
    """Token ids and sequence lengths the model's tables can look up: out of range they fail as a bare "index out of
    range in self" on the CPU and as a device-side assert (which poisons the CUDA context) on a GPU."""
    ids = tensors.get("input_ids")
    if ids is None or ids.is_floating_point() or ids.numel() == 0:
        return
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embedding = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    if isinstance(embedding, nn.Embedding):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= embedding.num_embeddings:
            bad = high if high >= embedding.num_embeddings else low
            raise ValueError(
                f"Batch {i} has token id {bad}, but the model's embedding has {embedding.num_embeddings} rows "
                f"(ids 0..{embedding.num_embeddings - 1}); encode the texts with the model's own tokenizer."
            )
    types = tensors.get("token_type_ids")
    table = embedding_rows(model, "token_type_embeddings")
    if types is not None and table is not None and types.numel() and int(types.max()) >= table[1]:
        raise ValueError(f"Batch {i} has token_type_id {int(types.max())}, but the model knows {table[1]} types "
                         f"(config.type_vocab_size); use the model's own tokenizer.")
    positions = embedding_rows(model, "position_embeddings")
    if positions is not None and ids.dim() > 1 and ids.shape[-1] > positions[1]:
        raise ValueError(
            f"Batch {i} has sequences of {ids.shape[-1]} tokens, but the model has {positions[1]} positions "
            f"(config.max_position_embeddings); truncate to at most {positions[1]} tokens (tokenizer(..., "
            f"truncation=True, max_length={positions[1]}), or --max-length {positions[1]} on the command line)."
        )


def check_labels_present(batches: list[Any], names: Iterable[str], where: str) -> None:
    """Every dict batch holds labels under one of ``names``: without them a transformers model returns no loss, which
    faces with no ``loss_fn`` (the Trainer callback) would find only at their first measurement."""
    names = list(names)
    for i, batch in enumerate(batches):
        if isinstance(batch, Mapping) and not set(names) & set(batch):
            raise ValueError(
                f"{where}: batch {i} has no labels (its keys: {', '.join(map(str, batch))}; labels are looked for "
                f"under {', '.join(names)}), so the model returns no loss to measure; give the dataset a 'label' or "
                "'labels' column (or name yours in TrainingArguments.label_names), or pass batches that hold labels."
            )


def check_inputs(model: Any, batches: Any) -> list[Any]:
    """The model (see :func:`check_model`) and the batches as a list, each batch checked (see
    :func:`check_batch`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    check_model(model)
    if isinstance(batches, (Mapping, Tensor, str, bytes)) or not isinstance(batches, Iterable):
        raise TypeError(
            "batches must be an iterable of batches (e.g. a list of dicts of model inputs), "
            f"got {type(batches).__name__}."
        )
    check_not_rows(batches)
    try:
        batches = list(batches)
    except RuntimeError as err:  # torch's default collate, over rows whose token lists differ in length
        if "should be of equal size" not in str(err):
            raise
        raise ValueError(f"The batches' rows could not be stacked ({err}); {BATCHING_FIX}.") from None
    if not batches:
        raise ValueError("No batches were given; pass a non-empty list of batches (dicts of model inputs with labels).")
    for i, batch in enumerate(batches):
        check_batch(model, batch, i)
    return batches


def non_finite_loss(value: float, rho: float | None) -> FloatingPointError:
    """The error for a loss that is not finite, with its fix: at the unperturbed weights (``rho`` None), or at a
    point perturbed within radius ``rho``.

    Args:
        value: the loss.
        rho: the radius, or None at the unperturbed weights.

    Returns:
        The error to raise."""
    if rho is None:
        return FloatingPointError(f"The loss is {value} at the unperturbed weights; check the inputs, the labels and "
                                  "the model's buffers (e.g. BatchNorm statistics).")
    return FloatingPointError(f"The loss is {value} at a perturbed point (rho={rho}); lower rho.")
