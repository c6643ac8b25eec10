"""Symmetry coverage over every model type of the installed ``transformers``: mapped, verified, or why not.

For each model type of ``CONFIG_MAPPING_NAMES`` the sweep builds a tiny random instance from its default config
(sizes shrunk generically: hidden 32, 4 heads of 8, 2 KV heads where the config has them, 2 layers, vocabulary 128,
eager attention, float64; nested text/vision/audio configs alike; per-layer entries cut to the layers kept; where
the config's validators or the model's constructor refuse the result, :func:`_repair` changes the field the message
names), maps it with :func:`hf_geosharp.map_symmetries`
and runs the functional probe: after ``reparametrize(condition=100)`` every output must agree with the original to
``PROBE_TOL`` (relative). A negative control (the group element applied to ``G`` only, a deliberately wrong action)
must move the outputs by at least ``CONTROL_MIN``; otherwise the probe cannot see the attention and is reported as
inconclusive rather than passed.

Each type runs in a worker process with a per-type alarm, and the parent restarts a worker that crashes or hangs, so
one bad architecture costs at most its timeout. Everything is offline: a type that needs files from the Hub (a timm
backbone, a tokenizer) fails to build and says why.

Run from the repository root: ``nice -n 10 python -m experiments.coverage`` (about 12 minutes on two shared cores;
writes ``docs/results/coverage.json`` and
``docs/coverage.md``); ``--types bert,gpt2`` runs a sample.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import platform
import re
import select
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PROBE_TOL = 1e-6  # relative; float64 round-off is ~1e-13, float32 casts inside some eager attentions ~1e-7
CONTROL_MIN = 1e-3  # the wrong action must move the outputs at least this much for the probe to count
TYPE_TIMEOUT_S = 40
ROW, START = "@@ROW ", "@@START "
BATCH, SEQ, VOCAB = 2, 8, 128
DOCS = Path(__file__).resolve().parents[1] / "docs"

# key -> target; an integer config entry larger than its target is shrunk to it (never grown)
_SHRINK = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "d_embed", "embedding_size",
                     "word_embed_proj_dim", "text_embed_dim", "vision_embed_dim", "audio_embed_dim",
                     "hidden_dim_model"), 32),
    **dict.fromkeys(("projection_dim", "proj_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                     "kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_size", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"), 8),
    "qk_head_dim": 16,  # MLA: qk_nope_head_dim + qk_rope_head_dim
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
                     "num_encoder_layers", "num_decoder_layers", "text_layers", "vision_layers"), 2),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
                     "hidden_dim", "mlp_dim"), 64),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    "num_experts_per_tok": 2,
    **dict.fromkeys(("n_group", "topk_group"), 1),  # expert groups must divide the shrunk experts
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_target_positions"), 128),
    "max_source_positions": 32,
    "rotary_dim": 4,
}


_FILL_NONE = ("head_dim", "num_key_value_heads", "vocab_size", "intermediate_size")


def _shrink(values: dict[str, Any], kinds_first: bool = False) -> dict[str, Any]:
    """A copy of a config dict with every size entry shrunk; nested config dicts are shrunk too."""
    out: dict[str, Any] = {}
    n_specials = 0
    for key, value in values.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = _shrink(value, kinds_first)
        elif isinstance(value, dict) and isinstance(value.get("mrope_section"), list):
            n = len(value["mrope_section"])  # multimodal RoPE sections must add up to head_dim / 2 = 4
            sections = [4 // n] * n
            sections[0] += 4 - sum(sections)
            out[key] = {**value, "mrope_section": sections}
        elif isinstance(value, bool):
            out[key] = value
        elif value is None and key in _FILL_NONE:
            out[key] = _SHRINK[key]  # left for a checkpoint to set, but read by the constructor
        elif isinstance(value, list) and key in _SHRINK and value and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            # per-stage heads, per-layer widths: a power of two, so that heads divide the (doubling) stage widths
            out[key] = [v if v <= 1 else 2 ** int(math.log2(min(v, _SHRINK[key]))) for v in value]
        elif isinstance(value, int) and key in _SHRINK and value > _SHRINK[key]:
            out[key] = _SHRINK[key]
        elif key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB - 16:
            n_specials += 1
            out[key] = VOCAB - n_specials  # special ids must fit the shrunk vocabulary (random ids stay below 100)
        elif key.endswith("_token_id") and isinstance(value, list) and all(isinstance(v, int) for v in value):
            out[key] = [v if v < VOCAB - 16 else VOCAB - 1 for v in value]
        else:
            out[key] = value
    if "kv_lora_rank" in out:  # MLA: kv_b_proj makes one key per query head; RoPE acts on qk_rope_head_dim only
        if isinstance(out.get("num_key_value_heads"), int):
            out["num_key_value_heads"] = out.get("num_attention_heads")
        factor = (out.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
        if isinstance(out.get("head_dim"), int) and isinstance(out.get("qk_rope_head_dim"), int):
            out["head_dim"] = int(out["qk_rope_head_dim"] / factor)
    if out.get("num_experts_per_tok", 0) is None and any(out.get(k) for k in ("n_routed_experts", "num_experts")):
        out["num_experts_per_tok"] = 2
    _per_layer(values, out, kinds_first)
    patch, size = out.get("patch_size"), out.get("image_size")
    if isinstance(patch, int) and isinstance(size, int) and size > 4 * patch:
        out["image_size"] = 4 * patch
    return out


def _per_layer(values: dict[str, Any], out: dict[str, Any], kinds_first: bool) -> None:
    """Cut per-layer entries (layer kinds and ``*layer*`` lists as long as a shrunk layer count, dicts keyed by layer
    index) to the new count; per-stage lists (a backbone's ``depths``) keep their stages."""
    shrunk = {values[k]: out[k] for k in _SHRINK if _SHRINK[k] == 2 and isinstance(values.get(k), int)
              and isinstance(out.get(k), int) and out[k] < values[k]}
    layers = out.get("num_hidden_layers")
    for key, value in out.items():
        per_layer = all(isinstance(v, str) for v in value) or "layer" in key if isinstance(value, list) else False
        if per_layer and len(value) in shrunk and _SHRINK.get(key) != 2:
            out[key] = _first_layers(value, shrunk[len(value)], kinds_first)
        elif isinstance(value, dict) and value and isinstance(layers, int) and all(
                str(k).isdigit() for k in value):
            out[key] = {k: v for k, v in value.items() if int(k) < layers}
    if isinstance(layers, int) and isinstance(out.get("layer_types"), list) and len(out["layer_types"]) > layers:
        out["layer_types"] = _first_layers(out["layer_types"], layers, kinds_first)


def _first_layers(value: list[Any], n: int, kinds_first: bool) -> list[Any]:
    """The first ``n`` per-layer entries; with ``kinds_first``, for layer kinds (strings) every kind first, so that a
    validator asking for at least one attention (or dense, or full) layer still finds it."""
    if not kinds_first or not all(isinstance(v, str) for v in value):
        return value[:n]
    kinds = list(dict.fromkeys(value))[:n]
    return kinds + value[:n - len(kinds)]


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random float64 eval-mode instance of ``model_type``'s base model (weights redrawn at std 0.2).

    The shrunk config must pass the config class's own validators and the model's constructor; where one refuses
    it, :func:`_repair` reads the message and adjusts the fields it names (at most ``_REPAIRS`` times), so one
    generic generator serves every type and :data:`OVERRIDES` holds only fields without a generic default."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = _default_config(config_cls).to_dict()
    values = {**_shrink(default), **OVERRIDES.get(model_type, {})}
    model_cls = _model_class(model_type, config_cls)
    kinds_first = False
    for attempt in range(_REPAIRS + 1):
        try:
            config = config_cls.from_dict(values)
            _eager(config)
            torch.manual_seed(seed)
            model = model_cls(config)
            break
        except Exception as exc:  # noqa: BLE001 - a validator's or constructor's refusal names what to repair
            if not kinds_first and attempt < _REPAIRS:  # first retry: keep every layer kind among the layers kept
                kinds_first = True
                values = {**_shrink(default, kinds_first=True), **OVERRIDES.get(model_type, {})}
                continue
            repaired = _repair(values, str(exc)) if attempt < _REPAIRS else None
            if repaired is None:
                raise
            logger.debug("%s: repaired the config after %s", model_type, _short(exc))
            values = repaired
    model = model.double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    return model


_REPAIRS = 6


def _default_config(config_cls: type) -> Any:
    """The default config, repaired where the defaults themselves fail the class's validators."""
    values: dict[str, Any] = {}
    for attempt in range(_REPAIRS + 1):
        try:
            return config_cls(**values)
        except Exception as exc:  # noqa: BLE001 - the validator's message names the field
            repaired = _repair(values, str(exc)) if attempt < _REPAIRS else None
            if repaired is None:
                raise
            values = repaired
    raise AssertionError("unreachable")
# fields that have no generic default (a value only the architecture determines), per model type
OVERRIDES: dict[str, dict[str, Any]] = {
    # Mamba heads must tile expand * hidden exactly (heads x head size), a product no single field implies
    "mamba2": {"num_heads": 4, "head_dim": 16, "expand": 2},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_expand": 2},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_expand": 2},
}


def _eager(config: Any) -> None:
    for cfg in [config] + [getattr(config, sub, None) for sub in getattr(config, "sub_configs", {}) or {}]:
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "eager"
            try:
                cfg._experts_implementation = "eager"  # grouped_mm kernels refuse float64
            except (ValueError, AttributeError, TypeError):
                pass  # no experts


def _model_class(model_type: str, config_cls: type) -> type:
    """The base model class: the auto mapping's, else ``<Name>Model``, else the modeling module's model class whose
    ``config_class`` is this config (sub-models such as a VQ-VAE or a text tower are not in the auto mapping)."""
    import importlib

    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type) or CONFIG_MAPPING_NAMES[model_type].removesuffix("Config") + "Model"
    model_cls = getattr(tf, name if isinstance(name, str) else name[0], None)
    if model_cls is not None:
        return model_cls
    try:
        module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        module = None
    classes = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, torch.nn.Module)
               and c.__module__ == module.__name__] if module else []
    found = [c for c in classes if issubclass(c, tf.PreTrainedModel) and getattr(c, "config_class", None) is config_cls]
    found.sort(key=lambda c: (not c.__name__.endswith("Model"), "For" in c.__name__, len(c.__name__)))
    # a sub-module with its own config (a prompt encoder, a mask decoder) is a plain module named after the config
    found += [c for c in classes if c.__name__ == config_cls.__name__.removesuffix("Config")]
    if not found:
        raise LookupError(f"no model class {name!r} in transformers")
    return found[0]


def _dicts(values: dict[str, Any]) -> list[dict[str, Any]]:
    """``values`` and every nested config dict in it."""
    out = [values]
    for value in values.values():
        if isinstance(value, dict):
            out += _dicts(value)
    return out


def _repair(values: dict[str, Any], message: str) -> dict[str, Any] | None:
    """A copy of ``values`` changed as the refusal ``message`` asks, or ``None`` if no rule applies."""
    import copy

    out = copy.deepcopy(values)
    named = [k for k in dict.fromkeys(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", message))
             if any(k in d for d in _dicts(out)) and len(k) > 2]

    def holder(key: str) -> dict[str, Any]:
        return next(d for d in _dicts(out) if key in d)

    forced = re.search(r"`?([A-Za-z_]\w*)`? must be (-?\d+), got", message)
    if forced:  # "x must be 0, got 256": the value is named, the field need not be in the dict yet
        key, value = forced[1], int(forced[2])
        where = next((d for d in _dicts(out) if key in d), out)
        if where.get(key) != value:
            where[key] = value
            return out
    target = re.search(r"`?([A-Za-z_][\w.]*)`?\s*\((-?\d+)\)\s*(?:must|should) (?:equal|be equal to|match)[^()]*"
                       r"\((-?\d+)\)", message)
    if target:  # "`a.b` (64) must equal `c // 4` (8)": set the field to the value in the second parentheses
        *path, key = target[1].split(".")
        where = next((d[path[-1]] for d in _dicts(out) if path and isinstance(d.get(path[-1]), dict)), None)
        where = where if where is not None and key in where else next((d for d in _dicts(out) if key in d), None)
        if where is not None and where.get(key) != int(target[3]):
            where[key] = int(target[3])
            return out
    changed = False
    if "out_features" in message or "out_indices" in message or "stage_names" in message:
        for d in _dicts(out):
            for key in ("out_features", "out_indices"):
                if d.get(key) is not None:
                    d[key], changed = None, True
    if "grouped-query" in message or ("num_key_value_heads" in named and "num_attention_heads" in named):
        for d in _dicts(out):
            if isinstance(d.get("num_key_value_heads"), int) and d.get("num_key_value_heads") != d.get(
                    "num_attention_heads"):
                d["num_key_value_heads"], changed = d.get("num_attention_heads"), True
    if changed:
        return out
    ints = [k for k in named if isinstance(holder(k).get(k), int) and not isinstance(holder(k).get(k), bool)]
    missing = [k for k in named if holder(k).get(k) is None]
    if missing and re.search(r"specified|required|must be set|must be provided|cannot be None|NoneType", message):
        key = missing[0]
        holder(key)[key] = 8 if key.endswith(("_length", "_len", "_size", "_dim")) else 2
        return out
    if re.search(r"equal|match|same as|must be", message) and len(ints) >= 2:
        first, second = ints[0], ints[1]
        if holder(first)[first] != holder(second)[second]:
            holder(first)[first] = holder(second)[second]
            return out
    if re.search(r"divid|multiple", message) and ints:
        sizes = {k: holder(k)[k] for k in ints}
        target = next((k for k in ints if k not in _SIZE_KEYS), ints[0])
        others = [v for k, v in sizes.items() if k != target and v > 0] or [32]
        divisor = math.gcd(sizes[target], *others) if sizes[target] > 0 else 1
        new = divisor if divisor != sizes[target] else max(1, sizes[target] // 2)
        holder(target)[target] = new
        return out
    return None


_SIZE_KEYS = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "intermediate_size"}


def _vision(config: Any) -> Any:
    return getattr(config, "vision_config", None) or config


def _candidate_inputs(model: torch.nn.Module, gen: torch.Generator) -> list[dict[str, Any]]:
    """Input dicts to try, simplest first (main input only, then text + image together)."""
    config = model.config
    sig = inspect.signature(model.forward).parameters
    ids = torch.randint(4, 100, (BATCH, SEQ), generator=gen)
    extra = {k: v for k, v in (("use_cache", False), ("return_dict", True)) if k in sig}
    vision = _vision(config)
    size = getattr(vision, "image_size", 32)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels = getattr(vision, "num_channels", 3)
    pixels = torch.randn(BATCH, channels, size, size, generator=gen, dtype=torch.float64)
    main = getattr(model, "main_input_name", "input_ids")
    base: dict[str, Any] = {}
    if main == "input_ids" or "input_ids" in sig and main not in sig:
        base["input_ids"] = ids
    elif main == "pixel_values":
        base["pixel_values"] = pixels
    elif main == "input_values":
        base["input_values"] = torch.randn(BATCH, 4000, generator=gen, dtype=torch.float64)
    elif main == "input_features":
        bins = getattr(config, "num_mel_bins", None) or getattr(config, "feature_size", 80)
        frames = 2 * (getattr(config, "max_source_positions", None) or 32)
        base["input_features"] = torch.randn(BATCH, bins, frames, generator=gen, dtype=torch.float64)
    else:
        base[main] = ids
    if "decoder_input_ids" in sig and getattr(config, "is_encoder_decoder", False):
        base["decoder_input_ids"] = ids[:, :5]
    out = [{**base, **extra}]
    if "pixel_values" in sig and "pixel_values" not in base:
        out.append({**base, "input_ids": ids, "pixel_values": pixels, **extra})
    return out


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every floating tensor in a model output, except caches (keys and values move with the group)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj} if obj.is_floating_point() else {}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        return out
    for key, value in items:
        if "past_key" in str(key) or "cache" in str(key):
            continue
        out.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _forward(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # models that draw noise in forward (ViT-MAE masking) draw the same noise each time
    with torch.no_grad():
        return {k: v.detach().clone() for k, v in _tensors(model(**inputs)).items()}


def relative_deviation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max`` over output tensors of ``||b - a|| / ||a||`` (a zero tensor counts by its absolute change)."""
    worst = 0.0
    for key, ref in a.items():
        diff = float((b[key] - ref).norm())
        scale = float(ref.norm())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _wrong_action(model: torch.nn.Module, smap: Any, seed: int) -> None:
    """The negative control: ``G <- G A^{-1}`` with ``H`` left alone, which no symmetry allows."""
    from hf_geosharp.engine.geometry.lie import random_group_element
    from hf_geosharp.symmetry.flat import flat_vector, parameters_in_order

    params = parameters_in_order(model, smap)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        flat = flat_vector(params)
        for block in smap.blocks:
            a = random_group_element(block.n_pairs, block.head_dim, lie_basis=block.lie_basis, condition=100.0,
                                     generator=gen)
            flat[block.G_index] = torch.linalg.solve(a, flat[block.G_index], left=False)
        for p, offset in zip(params, smap.offsets):
            p.copy_(flat[offset:offset + p.numel()].view_as(p))


def probe(model: torch.nn.Module, smap: Any) -> dict[str, Any]:
    """Reparametrise at condition 100 and compare all outputs; the wrong action is the control."""
    import hf_geosharp as gs

    gen = torch.Generator().manual_seed(0)
    errors = []
    for inputs in _candidate_inputs(model, gen):
        try:
            out0 = _forward(model, inputs)
            break
        except Exception as exc:  # noqa: BLE001 - any architecture-specific forward error is a finding
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    else:
        return {"status": "not_run", "reason": "forward with generic inputs failed: " + " | ".join(errors)}
    if not out0:
        return {"status": "not_run", "reason": "the model returned no floating tensor"}
    if not all(bool(torch.isfinite(t).all()) for t in out0.values()):
        return {"status": "not_run", "reason": "outputs are not finite at the random init"}
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    noise = relative_deviation(out0, _forward(model, inputs))
    try:
        gs.reparametrize(model, seed=1, condition=100.0, symmetry_map=smap)
        deviation = relative_deviation(out0, _forward(model, inputs))
        _restore(model, saved)
        _wrong_action(model, smap, seed=1)
        control = relative_deviation(out0, _forward(model, inputs))
    finally:
        _restore(model, saved)
    if noise > PROBE_TOL:
        status = "nondeterministic"
    elif deviation > PROBE_TOL or deviation != deviation:
        status = "failed"
    elif control < CONTROL_MIN:
        status = "inconclusive"
    else:
        status = "passed"
    return {"status": status, "max_rel_deviation": deviation, "control_rel_deviation": control,
            "rerun_rel_deviation": noise, "inputs": sorted(k for k in inputs if k not in ("use_cache", "return_dict"))}


def _restore(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def examine(model_type: str) -> dict[str, Any]:
    """One row of the coverage table for ``model_type``."""
    from hf_geosharp.pipeline import symmetry_map

    row: dict[str, Any] = {"model_type": model_type}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model(model_type)
    except Exception as exc:  # noqa: BLE001 - why a type cannot be built is the finding
        row.update(status="not_built", reason=_short(exc), seconds=round(time.perf_counter() - start, 2))
        return row
    row["model_class"] = type(model).__name__
    row["n_params"] = sum(p.numel() for p in model.parameters())
    try:
        smap = symmetry_map(model)
    except Exception as exc:  # noqa: BLE001 - a crash of the mapper is a bug to report, not to hide
        row.update(status="map_error", reason=_short(exc), seconds=round(time.perf_counter() - start, 2))
        return row
    modules = sorted({b.module for b in smap.blocks if b.kind in ("qk", "vo")})
    fallbacks = [{"module": f.module, "reason": f.reason[:160]} for f in smap.fallbacks]
    row.update(
        n_attention_modules=len(set(modules) | {f["module"] for f in fallbacks}),
        n_mapped_modules=len(modules),
        n_pairs_qk=sum(b.n_pairs for b in smap.blocks if b.kind == "qk"),
        n_pairs_vo=sum(b.n_pairs for b in smap.blocks if b.kind == "vo"),
        n_reduced_blocks=sum(b.lie_basis is not None for b in smap.blocks),
        layouts=sorted({b.note.split(";")[0] for b in smap.blocks}),
        n_fallbacks=len(fallbacks),
        fallbacks=fallbacks[:1],
        fallback_reasons=sorted({f["reason"].split(":")[0] for f in fallbacks}),
        notes=[n[:160] for n in smap.notes][:1],
    )
    if not smap.blocks:
        row["status"] = "fallback" if fallbacks else "no_attention"
    else:
        row["status"] = "partial" if fallbacks else "mapped"
        try:
            row["probe"] = probe(model, smap)
        except Exception as exc:  # noqa: BLE001
            row["probe"] = {"status": "not_run", "reason": "probe raised " + _short(exc)}
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def worker(types: list[str], timeout: int) -> None:
    """Examine ``types`` in order, one JSON line each on stdout; a per-type alarm bounds the time."""
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    for model_type in types:
        print(START + model_type, flush=True)
        signal.alarm(timeout)
        try:
            row = examine(model_type)
        except _Timeout:
            row = {"model_type": model_type, "status": "timeout", "reason": f"over {timeout} s"}
        except Exception as exc:  # noqa: BLE001 - e.g. the alarm landing inside an except clause
            row = {"model_type": model_type, "status": "crashed", "reason": _short(exc)}
        finally:
            signal.alarm(0)
        print(ROW + json.dumps(row, default=str), flush=True)


def sweep(types: list[str], timeout: int = TYPE_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run :func:`worker` in a subprocess, restarting it after a crash or a hang, and collect the rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    rows: dict[str, dict[str, Any]] = {}
    todo = list(types)
    while todo:
        cmd = [sys.executable, "-m", "experiments.coverage", "--worker", "--timeout", str(timeout),
               "--types", ",".join(todo)]
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        current, last = None, time.monotonic()
        assert proc.stdout is not None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 5.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith(START):
                    current, last = line[len(START):].strip(), time.monotonic()
                elif line.startswith(ROW):
                    row = json.loads(line[len(ROW):])
                    rows[row["model_type"]] = row
                    logger.info("%4d/%d %-40s %s", len(rows), len(types), row["model_type"],
                                row.get("probe", {}).get("status", row["status"]))
                    current = None
            elif current is not None and time.monotonic() - last > timeout + 30:
                proc.kill()  # stuck where the alarm cannot reach (inside C code)
                break
        proc.wait()
        if current is not None and current not in rows:
            rows[current] = {"model_type": current, "status": "timeout" if proc.returncode < 0 else "crashed",
                             "reason": f"worker exit code {proc.returncode} while examining it"}
        todo = [t for t in types if t not in rows]
    return [rows[t] for t in types]


def headline(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The counts the docs quote."""
    probe = Counter(r.get("probe", {}).get("status") for r in rows if r["status"] in ("mapped", "partial"))
    status = Counter(r["status"] for r in rows)
    verified = sum(1 for r in rows if r["status"] == "mapped" and r.get("probe", {}).get("status") == "passed")
    return {
        "tried": len(rows),
        "built": len(rows) - status["not_built"] - status["timeout"] - status["crashed"],
        "fully_mapped": status["mapped"],
        "fully_mapped_probe_verified": verified,
        "partially_mapped": status["partial"],
        "fallback_only": status["fallback"],
        "no_attention_found": status["no_attention"],
        "not_built": status["not_built"],
        "timeout_or_crash": status["timeout"] + status["crashed"],
        "map_error": status["map_error"],
        "probe_passed": probe["passed"],
        "probe_failed": probe["failed"],
        "probe_inconclusive": probe["inconclusive"],
        "probe_not_run": probe["not_run"],
        "probe_nondeterministic": probe["nondeterministic"],
    }


def _cell(text: str, width: int = 90) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text.replace("][", "]\\[")  # `x["a"]["b"]` in an error is text, not a Markdown reference link


def markdown(payload: dict[str, Any]) -> str:
    """``docs/coverage.md``: headline numbers, then one row per model type."""
    head, rows = payload["headline"], payload["rows"]
    lines = [
        "# Symmetry coverage over the installed transformers",
        "",
        f"Generated by `python -m experiments.coverage` (transformers {payload['transformers']}, torch "
        f"{payload['torch']}, {payload['seconds']:.0f} s). Every model type of `CONFIG_MAPPING_NAMES` was built as a "
        "tiny random float64 model from its default config (hidden 32, 4 heads of 8, 2 KV heads where the config has "
        "them, 2 layers, vocabulary 128, eager attention; per-layer lists cut to the layers kept; a field that a "
        "config validator or the constructor refuses is repaired as its message asks, and `OVERRIDES` holds the few "
        "fields with no generic default), mapped with `map_symmetries`, and probed: after "
        f"`reparametrize(condition=100)` every output tensor must agree to {PROBE_TOL:g} relative, and a deliberately "
        f"wrong action (`G A^-1` with `H` unchanged) must move them by at least {CONTROL_MIN:g}, otherwise the probe "
        "is inconclusive. Raw rows: `docs/results/coverage.json`.",
        "",
        "| | model types |",
        "|---|---|",
    ]
    labels = {
        "tried": "tried", "built": "built offline from the default config",
        "fully_mapped": "every attention module mapped",
        "fully_mapped_probe_verified": "... and probe-verified (invariant, control visible)",
        "partially_mapped": "partially mapped (some modules fall back)",
        "fallback_only": "attention found, none mapped",
        "no_attention_found": "no attention module found (convnets, SSMs, ...)",
        "not_built": "not built (needs files, special config or inputs)", "timeout_or_crash": "timeout or crash",
        "map_error": "map_symmetries raised", "probe_passed": "probe passed (mapped + partial)",
        "probe_failed": "**probe failed (wrong map)**", "probe_inconclusive": "probe inconclusive (control invisible)",
        "probe_not_run": "probe not run (generic inputs rejected)",
        "probe_nondeterministic": "outputs nondeterministic",
    }
    lines += [f"| {labels[k]} | {v} |" for k, v in head.items()]
    lines += ["", "Statuses: `mapped` (all attention mapped), `partial`, `fallback` (attention found, nothing mapped), "
              "`no_attention`, `not_built`. Probe: deviation after the symmetry / after the wrong control.", "",
              "| model type | status | layouts | QK / VO pairs (reduced blocks) | probe | dev / control | reason |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("probe", {})
        pairs = f"{r['n_pairs_qk']} / {r['n_pairs_vo']} ({r['n_reduced_blocks']})" if "n_pairs_qk" in r else ""
        dev = (f"{p['max_rel_deviation']:.1e} / {p['control_rel_deviation']:.1e}"
               if "max_rel_deviation" in p else "")
        fallback = r["fallbacks"][0]["reason"] if r.get("fallbacks") else ""
        reason = r.get("reason") or p.get("reason") or fallback
        lines.append(f"| {r['model_type']} | {r['status']} | {_cell(', '.join(r.get('layouts', [])), 60)} | {pairs} "
                     f"| {p.get('status', '')} | {dev} | {_cell(reason or '', 120)} |")
    return "\n".join(lines) + "\n"


def all_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return list(CONFIG_MAPPING_NAMES)


def main(argv: list[str] | None = None) -> int:
    from hf_geosharp.commands.common import Parser, file_path, positive
    from hf_geosharp.durable import OutputPathError, check_writable, write_json, write_text

    parser = Parser(prog="python -m experiments.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: all of the installed transformers)")
    parser.add_argument("--timeout", type=positive(int), default=TYPE_TIMEOUT_S, help="seconds per model type")
    parser.add_argument("--json", type=file_path, default=DOCS / "results" / "coverage.json")
    parser.add_argument("--markdown", type=file_path, default=DOCS / "coverage.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()] if args.types else all_types()
    if unknown := [t for t in types if t not in all_types()]:
        parser.error(f"--types: unknown model type(s) {', '.join(unknown)} (not in the installed transformers)")
    if not types:
        parser.error("--types: name at least one model type")
    if args.worker:
        worker(types, args.timeout)
        return 0
    try:
        check_writable(args.json)
        check_writable(args.markdown)
    except OutputPathError as err:
        parser.error(str(err))
    logger.addHandler(logging.StreamHandler())
    logger.setLevel(logging.INFO)
    import transformers

    start = time.perf_counter()
    rows = sweep(types, args.timeout)
    payload = {"transformers": transformers.__version__, "torch": torch.__version__,
               "python": platform.python_version(),
               "probe_tol": PROBE_TOL, "control_min": CONTROL_MIN, "timeout_s": args.timeout,
               "seconds": round(time.perf_counter() - start, 1), "headline": headline(rows), "rows": rows}
    write_json(args.json, payload, indent=None)
    write_text(args.markdown, markdown(payload))
    print(json.dumps(payload["headline"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
