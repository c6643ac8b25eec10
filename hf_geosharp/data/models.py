"""Loading a model, its tokenizer or image processor, and the task its head implies, with errors that name the fix
(what is missing and where, custom code, damaged weights)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError

from .spec import DataError, Task, not_found, require_existing_path


def task_of(model: torch.nn.Module) -> Task | None:
    """What the model's own loss measures, read from its class (``None``: no supported head); it decides where the
    labels come from.

    Args:
        model: the model.

    Returns:
        Its task (``classification``, ``causal-lm`` or ``masked-lm``), or ``None``.
    """
    from transformers.models.auto import modeling_auto as auto  # lazy: ~0.2 s, and only this check needs it

    def names(mapping: dict[str, Any]) -> set[str]:
        return {n for v in mapping.values() for n in ((v,) if isinstance(v, str) else v)}

    tasks = {
        "causal-lm": names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "masked-lm": names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        "classification": names(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
        | names(auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES),
    }
    for cls in type(model).__mro__:  # through wrappers that subclass the model's class (FSDP2's FSDPBert...)
        for task, classes in tasks.items():
            if cls.__name__ in classes:
                return task
    return None


def require_task(model: torch.nn.Module) -> Task:
    """:func:`task_of`, for faces that can only use the model's own loss.

    Args:
        model: the model.

    Returns:
        Its task; a ``DataError`` that names the supported heads when it has none.
    """
    task = task_of(model)
    if task is None:
        from ..engine.result import on_command_line

        encoder = ("`geosharp run --head --num-labels N` measures an encoder (a sentence-transformers folder, a bare "
                   "BertModel) with a new linear head initialised from --seed" if on_command_line() else
                   "pass loss_fn=(model, batch) -> loss to gs.geodesic_sharpness for any other loss")
        raise DataError(
            f"{type(model).__name__} has no supported task head, so its outputs carry no loss to measure sharpness on. "
            "Save a model with a sequence- or image-classification, causal-LM or masked-LM head (e.g. "
            f"BertForSequenceClassification); or {encoder}."
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
        raise not_found(what, model_id, err) from None


MODEL_PATH_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".ckpt")  # a file path, never a Hub id
CODE_CONFIGS = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")


def _local_auto_map(model_id: str) -> dict[str, list[str]]:
    """``{file: auto classes}`` for each file of a local model folder whose ``auto_map`` names custom code."""
    found = {}
    for name in CODE_CONFIGS:
        try:
            config = json.loads((Path(model_id) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("auto_map"):
            found[name] = sorted(config["auto_map"])
    return found


#: Seconds the one Hub lookup of a model id that is not cached may take before the Hub counts as unreachable.
HUB_LOOKUP_TIMEOUT = 10.0


def _hub_unreachable(model_id: str) -> str | None:
    """Why the Hub cannot serve ``model_id`` at once (``None``: it can, or it may: gated, private, an HTTP hiccup),
    from one lookup of its info (huggingface_hub's ``model_info``): without it, transformers retries an unreachable
    Hub for half a minute before it fails."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        huggingface_hub.model_info(model_id, timeout=HUB_LOOKUP_TIMEOUT)
    except GatedRepoError:
        return None  # it exists: transformers says how to get access
    except RepositoryNotFoundError:
        return ("and the Hugging Face Hub has no model of that name (a private one needs `hf auth login` or "
                "HF_TOKEN)")
    except HfHubHTTPError:
        return None
    except Exception:  # noqa: BLE001 - no network, DNS, a timeout: whichever HTTP client raised it
        return "and the Hugging Face Hub cannot be reached (no network?)"
    return None


def require_model(model_id: str, what: str = "the model folder") -> None:
    """Refuse at once a model that can be neither a local folder nor a Hub model this machine can get: a path that
    does not exist, a name that is no valid Hub id, or a Hub id that is not in the local cache while the Hub is
    offline (``HF_HUB_OFFLINE=1``) or cannot be reached; all with the message a bad path gets. A cached or
    reachable Hub id passes (transformers loads it).

    Args:
        model_id: a local folder or a Hub id.
        what: what ``model_id`` was given as, as the message names it.
    """
    require_existing_path(what, model_id, MODEL_PATH_SUFFIXES)
    if Path(model_id).exists():
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    head = f"{what} {model_id!r} does not exist (no such file or folder here)"
    try:
        cached = try_to_load_from_cache(model_id, "config.json")
    except HFValidationError:
        raise DataError(f"{head}, and it is not a Hub id either; check the path. A Hub id looks like 'name' or "
                        "'org/name'.") from None
    if isinstance(cached, str):
        return
    why = ("and it is not in the local Hugging Face cache while the Hub is offline (HF_HUB_OFFLINE=1)"
           if constants.HF_HUB_OFFLINE else _hub_unreachable(model_id))
    if why is not None:
        raise DataError(f"{head}, {why}; check the path. A Hub id looks like 'name' or 'org/name'.")


def load_model(model_id: str, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """Load a model with the task head its config names (``config.architectures``), in eval mode.

    A folder whose config, tokenizer or processor files name custom code (``auto_map``) is refused before any of that
    code is imported, unless ``trust_remote_code=True``.

    Args:
        model_id: a local folder or a Hub id.
        trust_remote_code: allow the folder's custom model code (``auto_map``) to run.

    Returns:
        The model with its task head, in eval mode.
    """
    if not isinstance(model_id, (str, os.PathLike)):
        raise DataError(f"model_id must be a folder path or a Hub id (a string), got {type(model_id).__name__}.")
    model_id = str(model_id)
    require_model(model_id)
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
    """Whether the model takes images (``pixel_values``) rather than token ids.

    Args:
        model: the model.

    Returns:
        ``True`` when the model's forward takes ``pixel_values``.
    """
    return getattr(model, "main_input_name", "input_ids") == "pixel_values"


def load_processor(model_id: str, model: torch.nn.Module, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer (text models) or image processor (vision models) saved with the model.

    A tokenizer without a pad token pads with its EOS token, and a model without ``config.pad_token_id`` gets that id
    (GPT-2-style classification heads find each row's last token by it).

    Args:
        model_id: the folder or Hub id the model was loaded from.
        model: the loaded model: its kind picks tokenizer or image processor, and its missing ``config.pad_token_id`` is
            set.
        trust_remote_code: allow custom tokenizer or processor code to run.

    Returns:
        The tokenizer or image processor.
    """
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
