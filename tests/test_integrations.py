"""The Trainer integration: the callback leaves the training run exactly as it would have been, logs what the Python
API computes on the same batches, once per measurement and through the callback handler; ``measure_trainer`` equals
the API on the subset it documents."""

from __future__ import annotations

import math
import random

import datasets
import numpy as np
import pytest
import torch

import hf_geosharp as gs
from hf_geosharp.integrations import GeodesicSharpnessCallback, measure_trainer
from hf_geosharp.measures import Settings

from .fixtures.hf_models import one_thread, sentences, tiny_tokenizer  # noqa: F401

SETTINGS = Settings(rho=0.05, steps=2, seed=0)
KEYS = ("geodesic_sharpness_inv", "adaptive_sharpness")


def _model():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )  # fmt: skip  (dropout on: the run draws random numbers every step, so a stolen draw would show)
    return BertForSequenceClassification(config)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    texts, labels = sentences(24, seed=2)
    ds = datasets.Dataset.from_dict({"text": texts, "label": labels})
    ds = ds.map(lambda row: tokenizer(row["text"], truncation=True), batched=True)  # "text" stays: must be dropped
    return tokenizer, ds


class Recorder:
    """A reporting integration stand-in: what the callback handler hands to on_log, and the weights when measured."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self
        self.logs, self.weights = [], {}

        class _Callback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                outer.logs.append(dict(logs))

            def on_step_end(self, args, state, control, model=None, **kwargs):
                outer.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

        self.callback = _Callback()


def _train(tmp_path, data, callbacks, **precision):
    from transformers import Trainer, TrainingArguments

    tokenizer, ds = data
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, logging_steps=2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, dataloader_num_workers=0, **precision,
    )  # fmt: skip
    trainer = Trainer(model=_model(), args=args, train_dataset=ds, processing_class=tokenizer, callbacks=callbacks)
    trainer.train()
    trainer.rng_after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    return trainer


def test_callback_keeps_the_trajectory_and_logs_the_api_values(tmp_path, data):
    plain = _train(tmp_path / "plain", data, [])
    recorder = Recorder()
    callback = GeodesicSharpnessCallback(eval_dataset=data[1], every_n_steps=2, measures=KEYS, n_examples=6,
                                         settings=SETTINGS)  # fmt: skip
    measured = _train(tmp_path / "measured", data, [callback, recorder.callback])

    # the training run is exactly the one without the callback: weights, optimizer state, random stream, losses
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), measured.model.state_dict().items()):
        assert torch.equal(a, b), name
    opt_a, opt_b = plain.optimizer.state_dict()["state"], measured.optimizer.state_dict()["state"]
    assert opt_a.keys() == opt_b.keys()
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])
    assert torch.equal(plain.rng_after[0], measured.rng_after[0])  # the random streams continue alike
    assert (plain.rng_after[1] == measured.rng_after[1]).all() and plain.rng_after[2] == measured.rng_after[2]
    losses = [e for e in plain.state.log_history if "loss" in e]
    assert [e for e in measured.state.log_history if "loss" in e] == losses and len(losses) == 2  # steps 2 and 4

    # one entry per measurement (steps 2 and 4; the end is step 4, not measured twice), handed to every reporter,
    # as evaluation metrics (eval_*: the reporters file them under eval/, not train/), each with its certificate
    entries = [e for e in measured.state.log_history if "eval_geodesic_sharpness_inv" in e]
    assert [e["step"] for e in entries] == [2, 4]
    assert [r for r in recorder.logs if "eval_geodesic_sharpness_inv" in r] == [
        {k: v for k, v in e.items() if k != "step"} for e in entries
    ]
    assert set(entries[0]) == {*(f"eval_{k}{s}" for k in KEYS for s in ("", "_stderr", "_certified")),
                               "eval_clean_loss", "epoch", "step"}
    for entry, measurement in zip(entries, callback.history):
        assert all(entry[f"eval_{k}_certified"] is measurement["results"][k]["converged"] for k in KEYS)

    # the values are the API's on the same batches at the same weights
    for entry in entries:
        model = _model().eval()
        model.load_state_dict(recorder.weights[entry["step"]])
        ref = gs.geodesic_sharpness(model, callback.batches, rho=0.05, steps=2, seed=0, metric="inv", progress=False)
        assert entry["eval_geodesic_sharpness_inv"] == pytest.approx(ref.value, rel=1e-6, abs=1e-9)
        assert entry["eval_clean_loss"] == pytest.approx(ref.clean_loss, rel=1e-6)
        base = gs.adaptive_sharpness(model, callback.batches, rho=0.05, steps=2, seed=0, progress=False)
        assert entry["eval_adaptive_sharpness"] == pytest.approx(base.value, rel=1e-6, abs=1e-9)
    assert entries[0]["eval_geodesic_sharpness_inv"] != entries[1]["eval_geodesic_sharpness_inv"]  # weights moved
    # the subset: 6 rows in batches of 4, columns the model takes ("text" dropped), padded by the tokenizer
    assert [len(b["labels"]) for b in callback.batches] == [4, 2]
    assert "text" not in callback.batches[0] and "input_ids" in callback.batches[0]
    assert [h["step"] for h in callback.history] == [2, 4]


def test_measure_trainer_equals_the_api_on_its_documented_subset(tmp_path, data):
    trainer = _train(tmp_path, data, [])
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    state = torch.get_rng_state()
    results = measure_trainer(trainer, n_examples=100, measures="inv", settings=SETTINGS, batch_size=8)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    res = results["geodesic_sharpness_inv"]
    assert len(res.per_batch) == 3  # the cap: all 24 rows, in batches of 8
    # the same subset built by hand: the Trainer's collator on the model's columns of every row
    rows = [{k: data[1][i][k] for k in ("input_ids", "token_type_ids", "attention_mask", "label")} for i in range(24)]
    batches = [dict(trainer.data_collator(rows[s : s + 8])) for s in range(0, 24, 8)]
    ref = gs.geodesic_sharpness(trainer.model, batches, rho=0.05, steps=2, seed=0, progress=False)
    assert res.value == pytest.approx(ref.value, rel=1e-6) and math.isfinite(res.value)


def test_a_bf16_trainer_is_measured_without_its_autocast_and_says_so(tmp_path, data, caplog):
    """Under ``bf16=True`` the accelerator wraps the model's forward in autocast: the callback and
    ``measure_trainer`` measure the float32 weights with the model's own forward (the API's number on those
    weights), record it in each result's config, say it once, and leave training as it is without them."""
    plain = _train(tmp_path / "plain", data, [], bf16=True)
    recorder = Recorder()
    callback = GeodesicSharpnessCallback(eval_dataset=data[1], every_n_steps=2, measures="inv", n_examples=6,
                                         settings=SETTINGS)  # fmt: skip
    with caplog.at_level("WARNING", logger="hf_geosharp"):
        measured = _train(tmp_path / "measured", data, [callback, recorder.callback], bf16=True)
    assert "forward" in vars(measured.model)  # the accelerator's autocast wrapper, left for training
    for (name, a), (_, b) in zip(plain.model.state_dict().items(), measured.model.state_dict().items()):
        assert torch.equal(a, b), name
    said = [r.getMessage() for r in caplog.records if "autocast" in r.getMessage()]
    assert len(said) == 1 and "bfloat16" in said[0], said
    entries = [e for e in measured.state.log_history if "eval_geodesic_sharpness_inv" in e]
    assert [e["step"] for e in entries] == [2, 4]
    for entry, measurement in zip(entries, callback.history):
        assert measurement["results"]["geodesic_sharpness_inv"]["config"]["autocast"] == "bfloat16 set aside"
        model = _model().eval()
        model.load_state_dict(recorder.weights[entry["step"]])
        ref = gs.geodesic_sharpness(model, callback.batches, rho=0.05, steps=2, seed=0, metric="inv", progress=False)
        assert entry["eval_geodesic_sharpness_inv"] == pytest.approx(ref.value, rel=1e-6, abs=1e-9)
        assert entry["eval_clean_loss"] == pytest.approx(ref.clean_loss, rel=1e-6)
    results = measure_trainer(measured, n_examples=8, measures="inv", settings=SETTINGS, batch_size=4)
    res = results["geodesic_sharpness_inv"]
    assert res.config["autocast"] == "bfloat16 set aside"
    picked = sorted(torch.randperm(24, generator=torch.Generator().manual_seed(0))[:8].tolist())
    batches = [dict(measured.data_collator([{k: data[1][i][k] for k in ("input_ids", "token_type_ids",
                                                                        "attention_mask", "label")}
                                            for i in picked[s : s + 4]])) for s in (0, 4)]
    model = _model().train(measured.model.training)  # the same weights and mode, with no autocast wrapper
    model.load_state_dict(measured.model.state_dict())
    ref = gs.geodesic_sharpness(model, batches, rho=0.05, steps=2, seed=0, metric="inv", progress=False)
    assert res.value == pytest.approx(ref.value, rel=1e-6)


def test_callback_arguments_are_checked():
    assert gs.measure_trainer is measure_trainer and gs.GeodesicSharpnessCallback is GeodesicSharpnessCallback
    with pytest.raises(ValueError, match="exactly one of batches="):
        GeodesicSharpnessCallback()
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer"):
        GeodesicSharpnessCallback(batches=[{}], every_n_steps=0)
    with pytest.raises(ValueError, match="unknown measure"):
        GeodesicSharpnessCallback(batches=[{}], measures="euclid")


def test_fixed_batches_with_the_trainer_given_are_measured_once_at_the_end(tmp_path, data):
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    tokenizer, ds = data
    rows = [{k: ds[i][k] for k in ("input_ids", "attention_mask", "label")} for i in range(6)]
    batches = [dict(DataCollatorWithPadding(tokenizer)(rows[s : s + 3])) for s in (0, 3)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=10)  # fmt: skip
    trainer = Trainer(model=_model(), args=args, train_dataset=ds, processing_class=tokenizer)
    recorder = Recorder()
    trainer.add_callback(GeodesicSharpnessCallback(batches, measures="mix", settings=SETTINGS, trainer=trainer))
    trainer.add_callback(recorder.callback)
    trainer.train()
    entries = [e for e in trainer.state.log_history if "eval_geodesic_sharpness_mix" in e]
    assert [e["step"] for e in entries] == [3]
    assert len([r for r in recorder.logs if "eval_geodesic_sharpness_mix" in r]) == 1
    model = _model().eval()
    model.load_state_dict(recorder.weights[3])
    ref = gs.geodesic_sharpness(model, batches, metric="mix", rho=0.05, steps=2, seed=0, progress=False)
    assert entries[0]["eval_geodesic_sharpness_mix"] == pytest.approx(ref.value, rel=1e-6)
    engine_stderr = getattr(ref, "stderr", math.nan)  # passed through as the engine reports it
    assert entries[0]["eval_geodesic_sharpness_mix_stderr"] == pytest.approx(engine_stderr, nan_ok=True)


@pytest.mark.parametrize("case", ["no labels", "token ids beyond the vocabulary"])
def test_what_the_first_measurement_would_refuse_stops_training_before_its_first_step(tmp_path, data, case):
    """An eval dataset without labels is refused by ``on_train_begin``, before any training time is spent, not at the
    first measurement (step 500 of a real run); and so is anything else the engine would refuse."""
    from transformers import Trainer, TrainingArguments

    tokenizer, ds = data
    if case == "no labels":
        subset, message = ds.remove_columns("label"), r"batch 0 has no labels \(its keys: .*input_ids.*'labels' column"
    else:
        subset, message = ds.map(lambda row: {"input_ids": [150] * len(row["input_ids"])}), "token id 150"
    recorder = Recorder()
    callback = GeodesicSharpnessCallback(eval_dataset=subset, every_n_steps=2, measures="inv", n_examples=6,
                                         settings=SETTINGS)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer,
                      callbacks=[callback, recorder.callback])
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0 and recorder.weights == {}  # not one training step was spent
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _MLP(torch.nn.Module):
    """No attention: nothing to quotient. At rho 0.5 one solver step is not stationary; twenty are."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}


@pytest.mark.parametrize("steps", [1, "auto"])
def test_each_logged_value_carries_its_certificate_and_an_uncertified_measurement_warns_once(caplog, steps):
    """Two measurements of an MLP: every worst-case value is logged with eval_<key>_certified (the engine's
    ``converged``) under the reporters' eval/ prefix; a measurement with values that are not certified gives one
    warning that shows them as lower bounds (no per-result warning besides), a certified one none; the note that
    nothing is quotiented comes once per training run, not once per measurement."""
    import warnings

    from transformers.integrations.integration_utils import rewrite_logs
    from transformers.trainer_callback import TrainerControl, TrainerState

    torch.manual_seed(1)
    batches = [{"x": torch.randn(8, 4), "labels": torch.randint(0, 2, (8,))} for _ in range(2)]
    callback = GeodesicSharpnessCallback(batches, every_n_steps=1, measures="inv,adaptive",
                                         settings=Settings(rho=0.5, steps=steps, seed=0))
    model, state, control = _MLP(), TrainerState(), TrainerControl()
    with caplog.at_level("WARNING", logger="hf_geosharp"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            state.global_step = step
            callback.on_step_end(None, state, control, model=model)
    assert not [w for w in caught if issubclass(w.category, (gs.NotConvergedWarning, gs.api.NoSymmetryWarning))]
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "no attention head pairs" in m]) == 1
    uncertified = [m for m in messages if "not certified" in m]
    flags = [{k: e[f"eval_{k}_certified"] for k in KEYS} for e in state.log_history]
    assert flags == [{k: h["results"][k]["converged"] for k in KEYS} for h in callback.history]
    if steps == 1:
        assert flags == [dict.fromkeys(KEYS, False)] * 2 and len(uncertified) == 2
        value = state.log_history[0]["eval_adaptive_sharpness"]
        assert uncertified[0].startswith("sharpness at step 1 is not certified, each value a lower bound")
        assert f"adaptive_sharpness ≥ {value:.4g} (not certified)" in uncertified[0]
    else:
        assert flags == [dict.fromkeys(KEYS, True)] * 2 and uncertified == []
    tensorboard = rewrite_logs(state.log_history[0])  # what TensorBoard, W&B, ... are handed
    assert {k for k in tensorboard if "sharpness" in k or "loss" in k} == {
        f"eval/{k}{s}" for k in KEYS for s in ("", "_stderr", "_certified")} | {"eval/clean_loss"}


def test_the_average_case_has_no_certificate_to_log():
    from transformers.trainer_callback import TrainerControl, TrainerState

    torch.manual_seed(1)
    batches = [{"x": torch.randn(8, 4), "labels": torch.randint(0, 2, (8,))}]
    callback = GeodesicSharpnessCallback(batches, measures="adaptive", settings=Settings(mode="average", n_samples=4))
    state = TrainerState()
    callback.on_train_end(None, state, TrainerControl(), model=_MLP())
    assert "eval_adaptive_sharpness" in state.log_history[0]
    assert not [k for k in state.log_history[0] if k.endswith("_certified")]
