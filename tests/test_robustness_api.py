"""Robustness of the Python API and the evaluate module: bad inputs refused before the work with a message naming
the fix, and the restore guarantee extended to what a forward may change (buffers, config attributes, the global RNG).

Each refusal is checked to leave the model exactly as it was (weights, buffers, flags, grads, modes and config).
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import hf_geosharp as gs

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import FAST, assert_intact, snapshot, tiny_batches, tiny_bert, token_ids


def config_state(model: nn.Module) -> dict:
    return dict(vars(model.config))


# ------------------------------------------------------------------------------------------- checks before the work
def _with(key: str, value) -> list[dict]:
    batches = tiny_batches()
    batches[1] = {**batches[1], key: value}
    return batches


REFUSALS = [
    ("token-id-above-vocab", lambda: _with("input_ids", torch.full((4, 8), 150)), ValueError,
     "token id 150, but the model's embedding has 100 rows"),
    ("negative-token-id", lambda: _with("input_ids", torch.full((4, 8), -3)), ValueError, "token id -3"),
    ("longer-than-positions", lambda: [{"input_ids": torch.randint(0, 100, (2, 80)), "labels": torch.tensor([0, 1])}],
     ValueError, r"80 tokens, but the model has 64 positions .*max_length=64"),
    ("token-type-out-of-range", lambda: _with("token_type_ids", torch.full((4, 8), 5)), ValueError,
     "token_type_id 5"),
    ("float-class-labels", lambda: _with("labels", torch.tensor([0.0, 1.0, 2.0, 1.0])), ValueError,
     r"float labels .*labels\.long\(\)"),
    ("inference-tensors", lambda: _inference_batches(), ValueError, "made inside torch.inference_mode"),
]


def _inference_batches() -> list[dict]:
    with torch.inference_mode():
        return [{k: v.clone() for k, v in tiny_batches()[0].items()}]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
@pytest.mark.parametrize("measure", [gs.geodesic_sharpness, gs.adaptive_sharpness], ids=["geodesic", "adaptive"])
def test_bad_batches_are_refused_before_the_work(case, measure):
    _, batches, error, message = case
    model = tiny_bert()
    snap, config = snapshot(model), config_state(model)
    with pytest.raises(error, match=message):
        measure(model, batches(), **FAST)
    assert_intact(model, snap)
    assert config_state(model) == config


def _numpy_format() -> list[dict]:
    import datasets

    rows = tiny_batches(n=1)[0]
    ds = datasets.Dataset.from_dict({k: v.tolist() for k, v in rows.items()})
    return list(ds.with_format("numpy").iter(batch_size=4))


NOT_TENSORS = [
    ("datasets-numpy-format", _numpy_format, r"'input_ids' is a numpy\.ndarray"),
    ("numpy-array", lambda: _with("attention_mask", np.ones((4, 8), dtype=np.int64)), r"numpy\.ndarray"),
    ("numpy-scalar-labels", lambda: _with("labels", np.int64(1)), r"'labels' is a numpy\.int64"),
    ("python-int-labels", lambda: _with("labels", 1), r"'labels' is a int"),
    ("numpy-array-any-key", lambda: _with("output_attentions", np.bool_(False)), r"numpy\.bool"),
    ("pandas-series", lambda: _with("labels", __import__("pandas").Series([0, 1, 2, 1])), r"pandas\.Series"),
]


@pytest.mark.parametrize("case", NOT_TENSORS, ids=[c[0] for c in NOT_TENSORS])
def test_values_that_are_not_tensors_are_refused_before_the_work_naming_the_torch_format(case):
    """A dataset in the numpy format (which failed inside BERT with "'int' object is not callable"), numpy scalars,
    Python numbers and pandas objects are refused before any work, naming with_format('torch'); the model intact."""
    _, batches, message = case
    model = tiny_bert()
    snap = snapshot(model)
    for measure in (gs.geodesic_sharpness, gs.relative_flatness):
        with pytest.raises(TypeError, match=message) as info:
            measure(model, batches(), **({} if measure is gs.relative_flatness else FAST))
        assert "with_format('torch')" in str(info.value)
        assert_intact(model, snap)


def test_python_lists_are_refused_as_uncollated_rows():
    with pytest.raises(ValueError, match=r"'labels' is a list of 4 items.*with_format\('torch'\)"):
        gs.adaptive_sharpness(tiny_bert(), _with("labels", [0, 1, 2, 1]), **FAST)


def test_inference_mode_is_named():
    model, batches = tiny_bert(), tiny_batches()
    snap = snapshot(model)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"inside torch.inference_mode\(\); gradients are "
                                                                    "needed"):
        gs.geodesic_sharpness(model, batches, **FAST)
    assert_intact(model, snap)


def _inference_model() -> nn.Module:
    """A tiny BERT built inside torch.inference_mode() (all its weights and buffers are inference tensors), with a
    module in train mode, a frozen parameter and a gradient, so that the refusal can be seen to leave all of it."""
    with torch.inference_mode():
        model = tiny_bert()
    model.bert.pooler.train()
    return model


@pytest.mark.parametrize("measure", ["geodesic", "adaptive", "relative_flatness", "evaluate"])
def test_a_model_made_in_inference_mode_is_refused_before_the_work_and_left_as_it_was(measure, measurement):
    """Refused before any forward: a run to the end could not restore the model (torch's "Inplace update to inference
    tensor outside InferenceMode") and would leave config.problem_type set by the forward."""
    model = _inference_model()
    snap, config = snapshot(model), config_state(model)
    assert config["problem_type"] is None
    calls = {
        "geodesic": lambda m: gs.geodesic_sharpness(m, tiny_batches(), **FAST),
        "adaptive": lambda m: gs.adaptive_sharpness(m, tiny_batches(), **FAST),
        "relative_flatness": lambda m: gs.relative_flatness(m, tiny_batches(), n_samples=2),
        "evaluate": lambda m: measurement.compute(model=m, input_ids=token_ids(), labels=[0, 1, 2, 0, 1, 2],
                                                  steps=2, measures="inv"),
    }
    with pytest.raises(ValueError, match=r"made inside torch.inference_mode\(\) \(bert\.embeddings.*build or load "
                                         r"the model outside torch.inference_mode\(\).*copy\.deepcopy\(model\)"):
        calls[measure](model)
    assert_intact(model, snap)
    assert config_state(model) == config and all(t.is_inference() for t in model.state_dict().values())
    assert math.isfinite(gs.adaptive_sharpness(copy.deepcopy(model), tiny_batches(), **FAST).value)  # the named fix


@pytest.mark.parametrize("labels, per_example", [(torch.randint(0, 3, (4, 8)), 8),
                                                 (torch.rand(4, 8, dtype=torch.float64), 8)], ids=["ids", "floats"])
@pytest.mark.parametrize("measure", [gs.geodesic_sharpness, gs.adaptive_sharpness], ids=["geodesic", "adaptive"])
def test_one_label_per_token_for_a_per_sequence_head_is_refused(measure, labels, per_example):
    model = tiny_bert()
    snap, config = snapshot(model), config_state(model)
    with pytest.raises(ValueError, match=rf"Batch 1 has {per_example} labels per example \(labels of shape \[4, 8\]\), "
                                         r"but BertForSequenceClassification predicts one class per example; pass one "
                                         r"label per example \(shape \[4\]\).*token-classification head"):
        measure(model, _with("labels", labels), **FAST)
    assert_intact(model, snap)
    assert config_state(model) == config


def test_per_example_label_shapes_the_heads_take_are_still_accepted():
    """[batch, 1] class ids, and [batch, num_labels] float targets (multi-label) are one label set per example."""
    def every(labels: torch.Tensor) -> list[dict]:
        return [{**b, "labels": labels} for b in tiny_batches()]

    model = tiny_bert()
    assert math.isfinite(gs.adaptive_sharpness(model, every(torch.tensor([[0], [1], [2], [1]])), **FAST).value)
    model.config.problem_type = "multi_label_classification"
    multi = torch.tensor([[1.0, 0.0, 1.0]] * 4, dtype=torch.float64)
    assert math.isfinite(gs.adaptive_sharpness(model, every(multi), **FAST).value)


def test_evaluate_refuses_one_label_per_token_for_a_per_sequence_head(measurement):
    model = tiny_bert()
    snap = snapshot(model)
    per_token = [[1] * 7 for _ in range(6)]
    with pytest.raises(ValueError, match=r"7 labels per example .*predicts one class per example"):
        measurement.compute(model=model, input_ids=token_ids(), labels=per_token, steps=2, measures="inv")
    assert_intact(model, snap)


def test_integer_labels_for_a_regression_head_are_refused():
    model = tiny_bert(labels=1)
    with pytest.raises(ValueError, match=r"num_labels=1.*labels.float\(\)"):
        gs.adaptive_sharpness(model, tiny_batches(labels=1), **FAST)


def test_a_string_model_is_refused():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        gs.geodesic_sharpness("bert-base-uncased", tiny_batches(), **FAST)


def test_numpy_integers_are_accepted_and_stored_as_python_numbers():
    model = tiny_bert()
    plain = gs.geodesic_sharpness(model, tiny_batches(), rho=0.05, steps=3, seed=4, progress=False)
    numpy = gs.geodesic_sharpness(model, tiny_batches(), rho=np.float64(0.05),
                                  steps=np.int64(3), seed=np.int32(4), epsilon=np.float32(1e-6), progress=False)
    assert numpy.value == plain.value and numpy.per_batch == plain.per_batch
    assert type(numpy.config["steps"]) is int and type(numpy.config["seed"]) is int
    json.dumps(numpy.to_dict())  # plain numbers: serialisable without a default=


def test_tuple_outputs_give_the_loss_from_their_first_element():
    """return_dict=False: transformers returns (loss, logits) when labels are given."""
    model = tiny_bert()
    expected = gs.adaptive_sharpness(model, tiny_batches(), **FAST)
    model.config.return_dict = False
    assert isinstance(model(**tiny_batches()[0]), tuple)
    got = gs.adaptive_sharpness(model, tiny_batches(), **FAST)
    assert got.value == expected.value and got.clean_loss == expected.clean_loss


def test_tuple_outputs_without_a_loss_say_so():
    model = tiny_bert()
    model.config.return_dict = False
    batches = [{k: v for k, v in b.items() if k != "labels"} for b in tiny_batches()]
    with pytest.raises(ValueError, match="return_dict=False.*include `labels`"):
        gs.adaptive_sharpness(model, batches, **FAST)


# ------------------------------------------------------------------------------------------- restore guarantee
class Counting(nn.Module):
    """A wrapper whose forward changes buffers: one in place, one replaced by a new tensor, one added."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_bert()
        self.config = self.inner.config
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("last_loss", torch.zeros(()))

    def forward(self, **batch):
        out = self.inner(**batch)
        self.calls += 1
        self.last_loss = out.loss.detach().clone()  # a new tensor object
        self.register_buffer("cache", torch.ones(3))
        return out


def test_buffers_a_forward_changes_are_restored_bit_exact():
    model = Counting()
    snap = snapshot(model)
    calls, last = model.calls, model.last_loss
    gs.geodesic_sharpness(model, tiny_batches(), **FAST)
    assert_intact(model, snap)
    assert model.calls is calls and int(model.calls) == 0 and model.last_loss is last
    assert "cache" not in dict(model.named_buffers())


def test_config_problem_type_written_by_forward_is_restored():
    """Float labels make transformers set config.problem_type = 'multi_label_classification' on the user's model;
    after the call it is back, so a second call with class ids works and equals the call on a fresh model."""
    model = tiny_bert()
    before = config_state(model)
    multi = [{**b, "labels": nn.functional.one_hot(b["labels"], 3).double()} for b in tiny_batches()]
    gs.adaptive_sharpness(model, multi, **FAST)
    assert model.config.problem_type is None and config_state(model) == before
    second = gs.adaptive_sharpness(model, tiny_batches(), **FAST)
    assert second.value == gs.adaptive_sharpness(tiny_bert(), tiny_batches(), **FAST).value


class Noisy(nn.Module):
    """A model that draws random numbers in eval mode (e.g. a stochastic layer left on)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_bert()

    def forward(self, **batch):
        out = self.inner(**batch)
        out.loss = out.loss + 0.01 * torch.rand(()).to(out.loss.dtype)
        return out


def test_random_models_repeat_for_a_seed_and_leave_the_callers_rng_alone():
    model = Noisy()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = gs.geodesic_sharpness(model, tiny_batches(), seed=7, **FAST)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's stream is where it was
    torch.manual_seed(999)  # a different global state before the call changes nothing
    second = gs.geodesic_sharpness(model, tiny_batches(), seed=7, **FAST)
    assert second.per_batch == first.per_batch and second.clean_loss == first.clean_loss
    other = gs.geodesic_sharpness(model, tiny_batches(), seed=8, **FAST)
    assert other.per_batch_clean_loss != first.per_batch_clean_loss  # the seed does reach the model's draws


# ------------------------------------------------------------------------------------- evaluate module
# (the `measurement` fixture is in conftest.py; the token ids `token_ids` come from fixtures/intact.py)


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_evaluate_refuses_bad_batch_sizes(measurement, batch_size):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        measurement.compute(model=tiny_bert(), input_ids=token_ids(), labels=[0, 1, 2, 0, 1, 2], batch_size=batch_size,
                            steps=2)


def test_evaluate_refuses_an_attention_mask_shorter_than_its_tokens(measurement):
    """Padding the mask with zeros would drop the tokens it does not cover, silently."""
    ids = token_ids()
    mask = [[1] * len(r) for r in ids]
    mask[2] = mask[2][:4]
    model = tiny_bert()
    snap = snapshot(model)
    with pytest.raises(ValueError, match="example 2: attention_mask has 4 entries but input_ids has 7"):
        measurement.compute(model=model, input_ids=ids, attention_mask=mask, labels=[0, 1, 2, 0, 1, 2], steps=2)
    assert_intact(model, snap)


def test_evaluate_refuses_a_string_model(measurement):
    with pytest.raises((TypeError, ValueError), match="model"):
        measurement.compute(model="some string", input_ids=token_ids(), labels=[0, 1, 2, 0, 1, 2], steps=2)


def test_evaluate_regression_labels_give_the_true_clean_loss(measurement):
    """Float targets must reach the model as floats: truncated to integers, the clean loss would be another number."""
    model = tiny_bert(labels=1)
    ids = token_ids()
    targets = [2.7, -1.4, 0.55, 3.9, -2.25, 1.35]
    with torch.no_grad():
        true = float(model(input_ids=torch.tensor(ids), labels=torch.tensor(targets, dtype=torch.float64)).loss)
        cut = torch.tensor([float(int(t)) for t in targets], dtype=torch.float64)
        truncated = float(model(input_ids=torch.tensor(ids), labels=cut).loss)
    assert not math.isclose(true, truncated, rel_tol=1e-3)  # the test can tell the two apart
    out = measurement.compute(model=model, input_ids=ids, labels=targets, batch_size=6, steps=2, rho=0.05)
    assert out["clean_loss"] == pytest.approx(true, rel=1e-6)
