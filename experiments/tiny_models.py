"""A tiny random instance of any ``transformers`` model type from its default config: sizes shrunk generically
(hidden 32, 4 heads of 8, 2 KV heads where the config has them, 2 layers, vocabulary 128, eager attention, float64;
nested text/vision/audio configs alike; per-layer entries cut to the layers kept), and where the config's validators
or the model's constructor refuse the result, the field the message names repaired (:func:`repair`). The coverage
sweep (``experiments/coverage.py``) maps and probes what this builds."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch

logger = logging.getLogger(__name__)

VOCAB = 128


def short_error(exc: BaseException) -> str:
    """The exception's type and first line (at most 200 characters): what a report row says of a failure."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"



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


def shrink(values: dict[str, Any], kinds_first: bool = False) -> dict[str, Any]:
    """A copy of a config dict with every size entry shrunk; nested config dicts are shrunk too."""
    out: dict[str, Any] = {}
    n_specials = 0
    for key, value in values.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")):
            out[key] = shrink(value, kinds_first)
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
    it, :func:`repair` reads the message and adjusts the fields it names (at most ``_REPAIRS`` times), so one
    generic generator serves every type and :data:`OVERRIDES` holds only fields without a generic default."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = _default_config(config_cls).to_dict()
    values = {**shrink(default), **OVERRIDES.get(model_type, {})}
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
                values = {**shrink(default, kinds_first=True), **OVERRIDES.get(model_type, {})}
                continue
            repaired = repair(values, str(exc)) if attempt < _REPAIRS else None
            if repaired is None:
                raise
            logger.debug("%s: repaired the config after %s", model_type, short_error(exc))
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
            repaired = repair(values, str(exc)) if attempt < _REPAIRS else None
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


def repair(values: dict[str, Any], message: str) -> dict[str, Any] | None:
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
