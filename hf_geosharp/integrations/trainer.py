"""Sharpness next to the loss: a ``transformers.TrainerCallback``, and a one-call measurement after training.

Both measure on a fixed subset: ``n_examples`` rows drawn once with a generator seeded by ``seed`` (never the global
RNG), batched by the Trainer's data collator after dropping the columns the model's ``forward`` does not take (what the
Trainer itself does). The measurement runs on copies of every global random stream (torch CPU and CUDA, numpy,
``random``) and the engine restores weights, modes, ``requires_grad`` and ``.grad``, so a run with the callback ends
with the same weights, optimizer state and random state as a run without it.

The callback's numbers are evaluations of the model on the subset, so they are logged as evaluation metrics
(``eval_<key>``: the reporters file them under ``eval/``, not ``train/``), each worst case with its certificate
(``eval_<key>_certified``) and one warning per measurement that is not certified.

Under mixed precision (``bf16=True`` / ``fp16=True``) the Trainer's accelerator wraps ``model.forward`` in autocast.
The measurement sets that autocast aside and runs the model's own forward on its own weights (float32 when it trains
in mixed precision): a certificate holds at the resolution of the loss's dtype, which a bfloat16 forward would make
coarser than the weights' float32 says. Each result's ``config["autocast"]`` records it (``"bfloat16 set aside"``),
and a log line says it once per training run.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState
from transformers.training_args import TrainingArguments

from ..api import SharpnessResult, collected_convergence_notes, symmetry_note_given
from ..engine.checks import check_inputs, check_labels_present
from ..engine.defaults import SEED
from ..engine.model_function.objective import default_loss
from ..engine.result import LOWER_BOUND, NOT_CERTIFIED, certified, shown
from ..measures import Settings, parse_measures, result_fields
from ..pipeline import Request, measure

logger = logging.getLogger(__name__)

LABEL_COLUMNS = ("label", "label_ids", "labels")  # names the Trainer's collators turn into the model's labels


@contextlib.contextmanager
def untouched_rng() -> Iterator[None]:
    """Run the block on copies of the global random streams: training draws exactly what it would have drawn."""
    state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def autocast_set_aside(model: torch.nn.Module, args: TrainingArguments | None) -> tuple[Any, str | None]:
    """The loss through the model's own forward when the Trainer trains in mixed precision (its accelerator wraps
    ``model.forward`` in autocast, and the forward is what the engine calls), and the autocast's dtype; ``(None,
    None)`` without mixed precision. The model is not touched: the wrapper stays for training.

    Args:
        model: the Trainer's model.
        args: the Trainer's arguments (``bf16``, ``fp16``).

    Returns:
        ``(loss_fn or None, "bfloat16" / "float16" or None)``.
    """
    dtype = "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else None
    original = getattr(model, "_original_forward", None)  # accelerate keeps the forward it wrapped under this name
    if "forward" not in vars(model) or not callable(original):
        return None, dtype
    return (lambda _model, batch: default_loss(original, batch)), dtype or "mixed precision"


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """No autocast inside the block (a caller's own ``torch.autocast`` region included), on the CPU and CUDA."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    with contextlib.ExitStack() as stack:
        for device in devices:
            stack.enter_context(torch.autocast(device_type=device, enabled=False))
        yield


def _measure_plain(request: Request, autocast: str | None) -> dict[str, SharpnessResult]:
    """Measure without autocast and record it in each result's config."""
    with autocast_off():
        results = measure(request)
    for res in results.values():
        res.config["autocast"] = f"{autocast} set aside" if autocast else None
    return results


def _say_autocast(autocast: str | None) -> None:
    if autocast:
        logger.warning("the Trainer computes in %s autocast; sharpness is measured without it, with the model's own "
                       "weights and forward, so its certificate holds at the resolution of their dtype (training is "
                       "unchanged).", autocast)


def _precision_fix(model: torch.nn.Module) -> str | None:
    """The advice for an uncertified value when the model itself computes in a half-precision dtype (the resolution
    of its loss, not rho, keeps the starts from agreeing), else None."""
    low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()} & {"bfloat16", "float16"})
    if not low:
        return None
    return (f"the model computes in {low[0]}, whose loss resolution can keep the starts from agreeing: measure a "
            "float32 copy (copy.deepcopy(model).float())")


def input_columns(model: torch.nn.Module, args: TrainingArguments | None = None) -> set[str]:
    """The row keys the Trainer keeps: the arguments of ``model.forward`` (of the base model under PEFT) and labels."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(inspect.signature(base.forward).parameters) | set(LABEL_COLUMNS)
    return names | set(getattr(args, "label_names", None) or [])


def subset_batches(
    dataset: Any, n_examples: int, batch_size: int, seed: int, collate: Callable[[list], Any], keep: set[str] | None
) -> list[Any]:
    """``n_examples`` rows of ``dataset`` (all when it has fewer, with a warning), drawn with ``seed``, in batches."""
    try:
        n = len(dataset)
    except TypeError:
        raise ValueError("the dataset has no length (an iterable dataset); pass batches= instead.") from None
    if n == 0:
        raise ValueError("the dataset is empty.")
    if n_examples > n:
        logger.warning("n_examples=%d but the dataset has %d rows; measuring on all %d.", n_examples, n, n)
    picked = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: min(n_examples, n)]
    rows = [dataset[i] for i in sorted(picked.tolist())]
    if keep is not None:
        rows = [{k: v for k, v in r.items() if k in keep} if isinstance(r, Mapping) else r for r in rows]
    batches = [collate(rows[s : s + batch_size]) for s in range(0, len(rows), batch_size)]
    return [dict(b) if isinstance(b, Mapping) else b for b in batches]


def _default_collator(processing_class: Any) -> Callable[[list], Any]:
    """The Trainer's own default: pad with the tokenizer when there is one."""
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase, default_data_collator

    if isinstance(processing_class, PreTrainedTokenizerBase):
        return DataCollatorWithPadding(processing_class)
    return default_data_collator


def _calling_handler(callback: TrainerCallback) -> CallbackHandler | None:
    """The Trainer's callback handler that is calling ``callback``; callbacks are handed no reference to it."""
    frame = inspect.currentframe()
    for _ in range(8):
        frame = frame.f_back if frame is not None else None
        owner = frame.f_locals.get("self") if frame is not None else None
        if isinstance(owner, CallbackHandler) and callback in owner.callbacks:
            return owner
    return None


class GeodesicSharpnessCallback(TrainerCallback):
    """Measure sharpness every ``every_n_steps`` optimizer steps and at the end of training, and log it.

    The values (``eval_geodesic_sharpness_inv``, ``..._stderr``, ..., and ``eval_clean_loss``, the unperturbed loss
    on the subset; the prefix is ``metric_key_prefix``) go into ``state.log_history`` as their own entries and to
    every reporting integration (TensorBoard, W&B, ...) through the Trainer's ``on_log``, exactly once per
    measurement; the reporters file them under ``eval/``. Each worst-case value comes with
    ``eval_<key>_certified`` (True, or False: the value is a lower bound of the maximum, and one warning per
    measurement says which values and why); the average case and relative flatness have no certificate and no flag.
    ``history`` keeps the full results.

    Args:
        batches: fixed batches (dicts the model accepts, labels included); or
        eval_dataset: rows to draw ``n_examples`` from with ``seed``, collated as the Trainer collates its own.
        every_n_steps: measure when ``global_step`` is a multiple of it (``None``: only at the end).
        measures: measure keys or short forms (``"inv,mix,adaptive"``); default the bundle's defaults.
        n_examples: size of the subset (a cap: a smaller dataset is used whole, with a warning).
        batch_size: examples per batch (default: ``per_device_eval_batch_size``).
        seed: draws the subset; also the solver's seed unless ``settings`` is given.
        settings: the measures' shared settings (radius, ball, steps, ...); default the bundle's defaults.
        data_collator: collates ``eval_dataset`` rows (default: the training dataloader's collator).
        trainer: optional; without it the callback finds the Trainer's callback handler when training begins.
        metric_key_prefix: the logged keys' prefix, as in ``Trainer.evaluate`` (``"eval"``: ``eval/`` in the
            reporters).

    Every process measures all batches (no collective call, so ranks never wait for each other). The model's
    parameters must be whole on each process (not sharded by FSDP or DeepSpeed ZeRO-3).
    """

    def __init__(
        self,
        batches: Iterable[Any] | None = None,
        *,
        eval_dataset: Any = None,
        every_n_steps: int | None = None,
        measures: str | Iterable[str] | None = None,
        n_examples: int = 64,
        batch_size: int | None = None,
        seed: int = SEED,
        settings: Settings | None = None,
        data_collator: Callable[[list], Any] | None = None,
        trainer: Any = None,
        metric_key_prefix: str = "eval",
    ) -> None:
        if not isinstance(metric_key_prefix, str) or not metric_key_prefix:
            raise ValueError(f"metric_key_prefix must be a non-empty string (e.g. 'eval'), got {metric_key_prefix!r}.")
        if (batches is None) == (eval_dataset is None):
            raise ValueError("pass exactly one of batches= (fixed batches) or eval_dataset= (rows to draw from).")
        for name, value in (("every_n_steps", every_n_steps), ("n_examples", n_examples), ("batch_size", batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        self.keys = parse_measures(measures)
        self.settings = settings if settings is not None else Settings(seed=seed)
        self.every_n_steps, self.n_examples, self.batch_size, self.seed = every_n_steps, n_examples, batch_size, seed
        self.batches = list(batches) if batches is not None else None
        if self.batches is not None and not self.batches:
            raise ValueError("batches= is empty.")
        self.history: list[dict[str, Any]] = []
        self._dataset, self._collate = eval_dataset, data_collator
        self._handler = trainer.callback_handler if trainer is not None else None
        self._last_step: int | None = None
        self.prefix = metric_key_prefix
        self._symmetry_noted = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Draw the measuring subset and refuse, before any training, what the first measurement would refuse.

        Args:
            args: the Trainer's arguments.
            state: the Trainer's state (``global_step``).
            control: the Trainer's control flags.
            **kwargs: the Trainer's other callback keywords (model, optimizer, ...).
        """
        if self._handler is None:
            self._handler = _calling_handler(self)
            if self._handler is None:
                logger.warning("found no Trainer callback handler; sharpness goes to state.log_history only.")
        if self.batches is None:
            loader = kwargs.get("train_dataloader")
            collate = self._collate or getattr(loader, "collate_fn", None)
            collate = collate or _default_collator(kwargs.get("processing_class"))
            keep = input_columns(kwargs["model"], args) if args.remove_unused_columns else None
            size = self.batch_size or args.per_device_eval_batch_size
            with untouched_rng():  # a masking collator draws random numbers
                self.batches = subset_batches(self._dataset, self.n_examples, size, self.seed, collate, keep)
        # what the first measurement would refuse, refused now: before the training time is spent
        check_labels_present(self.batches, args.label_names or ["labels"], type(self).__name__)
        check_inputs(kwargs["model"], self.batches)
        self._last_step = None
        self._symmetry_noted = False
        _say_autocast(autocast_set_aside(kwargs["model"], args)[1])

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Measure every ``every_n_steps`` steps and at the last one.

        Args:
            args: the Trainer's arguments.
            state: the Trainer's state (``global_step``).
            control: the Trainer's control flags.
            **kwargs: the Trainer's other callback keywords (model, optimizer, ...).
        """
        due = self.every_n_steps is not None and state.global_step % self.every_n_steps == 0
        if due or control.should_training_stop:  # DefaultFlowCallback has already flagged the last step
            self._measure(args, state, control, kwargs["model"])

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Measure once more if training stopped at a step that was not measured (e.g. early stopping).

        Args:
            args: the Trainer's arguments.
            state: the Trainer's state (``global_step``).
            control: the Trainer's control flags.
            **kwargs: the Trainer's other callback keywords (model, optimizer, ...).
        """
        if self._last_step != state.global_step:  # training stopped early (e.g. EarlyStoppingCallback)
            self._measure(args, state, control, kwargs["model"])

    def _measure(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: Any) -> None:
        self._last_step = state.global_step
        # the note of a model with nothing to quotient comes with the first measurement only; the per-result
        # convergence warnings are replaced by one warning per measurement (below)
        quiet = symmetry_note_given() if self._symmetry_noted else contextlib.nullcontext()
        loss_fn, autocast = autocast_set_aside(model, args)
        with untouched_rng(), quiet, collected_convergence_notes():
            results = _measure_plain(Request(model, self.batches, self.keys, self.settings, loss_fn=loss_fn), autocast)
        self._symmetry_noted = True
        logs: dict[str, float | bool] = {}
        for key, res in results.items():  # scalars only: reporters log numbers, not lists
            fields = {k: v for k, v in result_fields(key, res).items() if not k.endswith("_per_batch")}
            if (flag := certified(res)) is not None:
                fields[f"{key}_certified"] = flag
            logs.update({f"{self.prefix}_{k}": v for k, v in fields.items()})
        logs[f"{self.prefix}_clean_loss"] = next(iter(results.values())).clean_loss
        self.history.append({"step": state.global_step, "results": {k: r.to_dict() for k, r in results.items()}})
        self._warn_uncertified(state.global_step, results, _precision_fix(model))
        self._log(args, state, control, logs)

    def _warn_uncertified(self, step: int, results: dict[str, SharpnessResult], precision: str | None) -> None:
        """One warning for a measurement with values that are not certified: which, shown as lower bounds, and why
        (``precision``: the advice when the model computes in half precision, which more steps or a lower rho
        would not fix)."""
        uncertified = {key: res for key, res in results.items() if certified(res) is False}
        if not uncertified:
            return
        which = "; ".join(f"{key} {shown(res.value, False)}: {res.convergence_note}"
                          for key, res in uncertified.items())
        fix = precision or ("settings=Settings(steps='auto') continues until certified or says why not"
                            if self.settings.steps != "auto" else "a lower rho is certified more easily")
        logger.warning("sharpness at step %d is %s, each value %s (logged with %s_<key>_certified = False): %s; %s.",
                       step, NOT_CERTIFIED, LOWER_BOUND, self.prefix, which, fix)

    def _log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict) -> None:
        """What ``Trainer.log`` does. The handler's ``on_log`` also clears ``control.should_log``, which would drop
        the training loss due at this step, so the flag is put back."""
        if state.epoch is not None:
            logs["epoch"] = state.epoch
        state.log_history.append({**logs, "step": state.global_step})
        if self._handler is not None:
            should_log = control.should_log
            self._handler.on_log(args, state, control, logs)
            control.should_log = should_log


def measure_trainer(
    trainer: Any,
    n_examples: int = 64,
    *,
    dataset: Any = None,
    measures: str | Iterable[str] | None = None,
    settings: Settings | None = None,
    batch_size: int | None = None,
    seed: int = SEED,
    progress: bool = False,
) -> dict[str, SharpnessResult]:
    """Measure ``trainer.model`` (e.g. after ``trainer.train()``) on ``n_examples`` rows drawn with ``seed`` from
    ``dataset`` (default: the trainer's eval dataset, else its train dataset), collated by its data collator.

    The model, the trainer and the global random streams are untouched. A trainer in mixed precision is measured
    without its autocast (module docstring), and each result's ``config["autocast"]`` says so.

    Args:
        trainer: a ``transformers.Trainer``; its model is measured.
        n_examples: rows to draw (a cap: a smaller dataset is used whole, with a warning).
        dataset: rows to draw from (default: the trainer's eval dataset, else its train dataset).
        measures: measure keys or short forms (``"inv,mix,adaptive"``); default the bundle's defaults.
        settings: the measures' shared settings (radius, ball, steps, ...); default the bundle's defaults.
        batch_size: examples per batch (default: the trainer's ``per_device_eval_batch_size``).
        seed: draws the rows; also the solver's seed unless ``settings`` is given.
        progress: show a progress bar.

    Returns:
        ``{measure key: SharpnessResult}``, e.g. ``{"geodesic_sharpness_inv": ...}``.
    """
    if dataset is None:
        dataset = trainer.eval_dataset if trainer.eval_dataset is not None else trainer.train_dataset
    if dataset is None:
        raise ValueError("the trainer has neither an eval_dataset nor a train_dataset; pass dataset=.")
    if isinstance(dataset, dict):
        raise ValueError(f"the trainer's eval_dataset is a dict of datasets ({sorted(dataset)}); pass dataset=one.")
    args = trainer.args
    keep = input_columns(trainer.model, args) if args.remove_unused_columns else None
    settings = settings if settings is not None else Settings(seed=seed)
    loss_fn, autocast = autocast_set_aside(trainer.model, args)
    _say_autocast(autocast)
    with untouched_rng():
        batches = subset_batches(
            dataset, n_examples, batch_size or args.per_device_eval_batch_size, seed, trainer.data_collator, keep
        )
        request = Request(trainer.model, batches, parse_measures(measures), settings, progress=progress,
                          loss_fn=loss_fn)
        return _measure_plain(request, autocast)
