"""Cutting an attention block out of a model for its audit: the arguments it receives, without the KV cache.

The block is called again and again with the arguments captured in one forward pass of the model (on random token
ids or pixels), so it must not carry state from one call to the next: a decoder's KV cache does, and is taken out.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from .audit import SKETCH_OVERSAMPLE, random_inputs
from .audit_rank import lower_precision_ops

# One sequence of L tokens shows at most 2 t L - t^2 - t QK directions of a t-column slice (its L x L scores, less
# the GL(t) overlap and softmax's row shifts), so short sequences cap the measured rank below the prediction
# (MiniLM, t = 2: 57 sequences of 8 tokens show 57 x 26 = 1,482 < 1,530). 64 tokens lift the cap above any slice.
SEQ_LEN = 64


def capture(model: nn.Module, block: nn.Module, batch: dict[str, Any]) -> tuple[tuple, dict]:
    """The positional and keyword arguments ``block`` receives in ``model(**batch)``, the KV cache taken out.

    Args:
        model: the whole model.
        block: one of its submodules.
        batch: the model's inputs.

    Returns:
        ``(args, kwargs)`` of the block's first call.
    """
    seen: list[tuple[tuple, dict]] = []

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if not seen:
            seen.append((args, dict(kwargs)))

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    if not seen:
        raise ValueError(f"the block {type(block).__name__} was not called by the model's forward")
    args, kwargs = seen[0]
    return args, without_cache(kwargs)


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The captured keyword arguments with the KV cache taken out.

    A decoder hands each attention block the model's cache (``cache``, ``past_key_values``, ``layer_past``, by
    version and family). Every later call of the block appends its keys and values to it, so the block would attend
    over twice the tokens its captured mask covers (the mask addition fails), and the audit would differentiate
    through stale keys. Without the cache the block recomputes its keys and values from its input on every call.

    Args:
        kwargs: the captured keyword arguments.

    Returns:
        A copy with every ``Cache`` replaced by ``None`` and ``use_cache`` (if passed) set to ``False``.
    """
    out = {k: None if isinstance(v, Cache) else v for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def first_tensor(out: Any) -> torch.Tensor:
    """The block's output tensor: the first element, recursively, of what it returns (attention weights follow)."""
    while not isinstance(out, torch.Tensor):
        out = out[0]
    return out


def block_inputs(
    model: nn.Module, block: nn.Module, n: int, gen: torch.Generator
) -> tuple[tuple, dict, torch.Tensor, int]:
    """The block's captured arguments, its input as ``[tokens, width]`` float64, and its output width.

    Enough tokens to span the input space and give more outputs than coordinates, in sequences long enough that one
    sequence's scores can show its share of the QK directions (see :data:`SEQ_LEN`).

    Args:
        model: the whole model (token or pixel inputs).
        block: the attention block.
        n: the number of audited coordinates.
        gen: the generator of the inputs.

    Returns:
        ``(args, kwargs, x, out_width)``.
    """
    make = random_inputs(model, seq_len=SEQ_LEN)
    args, kwargs = capture(model, block, make(gen, 8))
    width = (args[0] if args else kwargs["hidden_states"]).shape[-1]
    out_width = first_tensor(block(*args, **kwargs)).shape[-1]
    n_tokens = max(width + 1 + 16, math.ceil(1.25 * (n + SKETCH_OVERSAMPLE) / out_width))
    args, kwargs = capture(model, block, make(gen, n_tokens))
    x = (args[0] if args else kwargs["hidden_states"]).reshape(-1, width).to(torch.float64)
    return args, kwargs, x, out_width


def block_precision(model: nn.Module, block: nn.Module, seed: int = 0) -> list[str]:
    """The operations of one call of ``block`` (on 8 random tokens) that compute below float64 (see
    :func:`hf_geosharp.symmetry.audit_rank.lower_precision_ops`); empty when it is float64 throughout.

    Args:
        model: the whole model.
        block: the attention block.
        seed: seed of the random inputs.

    Returns:
        Sorted ``"op in dtype"`` strings.
    """
    args, kwargs = capture(model, block, random_inputs(model, seq_len=SEQ_LEN)(torch.Generator().manual_seed(seed), 8))
    return lower_precision_ops(block, args, kwargs)
