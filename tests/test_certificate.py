"""What the worst-case certificate certifies (docs/method.md, "Convergence" and "Precision"): two starts that agree
on a stationary point, judged against the resolution of the loss in its floating type; and the start rule on the
two demo-zoo batches where two agreeing starts had missed a higher maximum."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hf_geosharp as gs
from hf_geosharp.engine.solvers.certificate import (
    AT_PRECISION,
    CERTIFIED,
    NOT_CERTIFIED,
    PRECISION_FACTOR,
    SolveResult,
    loss_resolution,
)

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)


def _flat_bert() -> tuple[torch.nn.Module, list[dict]]:
    """A random-init float32 BERT (hidden 32, 2 layers, BERT's vocabulary) on a padded batch of 16 x 24 tokens whose
    second half repeats the first with the other label: the clean point is nearly stationary, and the worst-case
    increase (about 5e-6 on a loss of 0.69) is within a hundred float32 roundings of the loss."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    model = BertForSequenceClassification(config).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, config.vocab_size, (16, 24), generator=gen)
    lengths = torch.randint(6, 25, (16,), generator=gen)
    labels = torch.randint(0, 2, (16,), generator=gen)
    ids[8:], lengths[8:], labels[8:] = ids[:8], lengths[:8], 1 - labels[:8]
    mask = (torch.arange(24)[None] < lengths[:, None]).long()
    return model, [{"input_ids": ids * mask, "attention_mask": mask, "labels": labels}]


def test_a_float32_value_at_the_loss_resolution_is_certified_at_precision_within_a_small_budget():
    """In float32 the starts differ in the last bits of the loss, so they cannot agree within ``tol`` (they would
    spin to the 640-step budget, not converged): they are certified at precision within 160 steps, and the statement
    is true: the float64 maximum of the same model is within the stated resolution. The float64 run is certified
    within ``tol``."""
    model, batches = _flat_bert()
    res = gs.geodesic_sharpness(model, batches, steps="auto", max_steps=160, progress=False)
    assert res.certificate == AT_PRECISION and res.converged, res.convergence_note
    assert res.steps_used <= 160
    assert "float32" in res.convergence_note and "resolution" in res.convergence_note and "float32" in str(res)
    exact = gs.geodesic_sharpness(copy.deepcopy(model).double(), batches, steps="auto", progress=False)
    assert exact.certificate == CERTIFIED and exact.convergence_note is None
    floor = loss_resolution("float32", res.clean_loss, res.clean_loss + res.value)
    assert abs(res.value - exact.value) <= floor + 1e-3 * exact.value, (res.value, exact.value, floor)
    assert 1e-3 * exact.value < floor  # tol alone asks for agreement below float32's resolution here


def test_verdict_widens_the_tolerances_to_the_resolution_of_the_dtype_only():
    """The same starts, 1e-7 apart on a loss of 0.7: at precision in float32, different maxima in float64; a gap
    above ``tol`` but below the resolution is stationary at precision."""
    clean = 0.69
    values = [1.500e-5, 1.490e-5, 1.502e-5]
    agreeing = dict(max_loss=clean + max(values), clean_loss=clean, gap=5e-4, start_values=values,
                    start_gaps=[5e-4] * 3, start_kinds=["zero", "antipode", "near"])
    assert SolveResult(**agreeing, dtype="float32").verdict(1e-3, 2)[0] == AT_PRECISION
    state, note = SolveResult(**agreeing, dtype="float64").verdict(1e-3, 2)
    assert state == NOT_CERTIFIED and "different maxima" in note
    floor = PRECISION_FACTOR * torch.finfo(torch.float32).eps * (clean + max(values))
    steep = dict(agreeing, gap=0.5 * floor / max(values), start_values=[max(values)] * 2, start_gaps=[1e-4] * 2,
                 start_kinds=["zero", "antipode"])
    assert SolveResult(**steep, dtype="float32").verdict(1e-3, 2)[0] == AT_PRECISION
    assert SolveResult(**steep, dtype="float64").verdict(1e-3, 2)[0] == NOT_CERTIFIED
    exact = dict(steep, gap=1e-4)
    assert SolveResult(**exact, dtype="float32").verdict(1e-3, 2) == (CERTIFIED, None)


def test_a_random_start_above_two_agreeing_starts_leaves_the_value_uncertified():
    """Two starts agree on 5.26 and found a lower maximum too; a start from a random point reaches 5.93: the value
    is the largest found (5.93) and not certified, as agreement is no evidence of the largest maximum there."""
    values = [5.260, 4.625, 5.260, 5.928]
    res = SolveResult(max_loss=1 + 5.928, clean_loss=1.0, gap=1e-5, start_values=values, start_gaps=[1e-5] * 4,
                      start_kinds=["zero", "antipode", "near", "random"])
    state, note = res.verdict(1e-3, 2)
    assert state == NOT_CERTIFIED and "random point" in note and "lower bound" in note
    # a random start the budget stopped before it was stationary checks nothing
    unfinished = SolveResult(max_loss=1 + 5.26, clean_loss=1.0, gap=1e-5,
                             start_values=[5.26, 4.625, 5.26, 5.009, 5.147],
                             start_gaps=[1e-5, 6e-6, 1.6e-5, 1.4e-5, 0.2],
                             start_kinds=["zero", "antipode", "near", "random", "random"])
    state, note = unfinished.verdict(1e-3, 2)
    assert state == NOT_CERTIFIED and "random points" in note
    finished = SolveResult(**{**vars(unfinished), "start_gaps": [1e-5, 6e-6, 1.6e-5, 1.4e-5, 1e-5]})
    assert finished.verdict(1e-3, 2) == (CERTIFIED, None)


@pytest.fixture(scope="module")
def demo_batches(tmp_path_factory):
    """Batch 0 of the demo's data (256 training digits, batches of 64, seed 0) for zoo-03 and zoo-04, trained here
    (deterministic, portable kernels; about a minute) into a temporary cache: only these two members."""
    from hf_geosharp.data import DataSpec, load_batches, load_model, load_processor
    from hf_geosharp.zoo import build_zoo

    zoo = build_zoo("full", tmp_path_factory.mktemp("zoo"), progress=False, names=["zoo-03", "zoo-04"])
    data = DataSpec(dataset=str(zoo.data_dir), split="train", n_examples=256, batch_size=64, seed=0)
    out = {}
    for name in ("zoo-03", "zoo-04"):
        model = load_model(str(zoo.root / name))
        out[name] = model, load_batches(model, load_processor(str(zoo.root / name), model), data)[:1]
    return out


@pytest.mark.parametrize(("name", "metric", "rho", "higher"), [
    ("zoo-04", "mix", 0.02, 5.9278),  # two starts agreed on 5.2602; a random start reached 5.9278
    ("zoo-03", "inv", 0.1, 0.3120),  # two starts agreed on 0.3115 (gap 6e-5); every outside start reached 0.3120
])
def test_the_measured_misses_end_at_the_higher_maximum_or_uncertified(demo_batches, name, metric, rho, higher):
    model, batches = demo_batches[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.NotConvergedWarning)
        res = gs.geodesic_sharpness(model, batches, metric=metric, rho=rho, steps="auto", ball="paper",
                                     progress=False)
    assert res.value >= higher * (1 - 1e-3) or not res.converged, (res.value, res.convergence_note)


def _noisy_toy_bert() -> tuple[torch.nn.Module, list[dict]]:
    """A float64 BERT of width 8 (2 heads, 1 layer) whose weights carry 0.3 of Gaussian noise on top of the init,
    on one batch of 8 x 12 tokens: a landscape with several stationary points on a large ball."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                        vocab_size=50, max_position_embeddings=16)
    model = BertForSequenceClassification(config).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    ids = torch.randint(0, 50, (8, 12), generator=gen)
    return model, [{"input_ids": ids, "labels": torch.randint(0, 2, (8,), generator=gen)}]


@pytest.mark.parametrize("steps", [20, 400])
def test_a_fixed_budget_is_one_start_and_never_certified(steps):
    """Certified means checked beyond one stationary point (docs/method.md, "Convergence"): a fixed budget is one
    start, so its value is a lower bound whatever its Frank-Wolfe gap, and says so; ``steps="auto"`` certifies,
    and its value is at least the fixed budget's (within ``tol``)."""
    model, batches = _noisy_toy_bert()
    settings = dict(metric="mix", ball="paper", rho=0.5, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fixed = gs.geodesic_sharpness(model, batches, steps=steps, **settings)
    assert not fixed.converged and fixed.certificate == NOT_CERTIFIED
    assert "fixed budget" in fixed.convergence_note or "not stationary" in fixed.convergence_note
    assert any(issubclass(w.category, gs.NotConvergedWarning) for w in caught)
    auto = gs.geodesic_sharpness(model, batches, **settings)  # the default: steps="auto"
    assert auto.config["steps"] == "auto"
    if auto.converged:
        assert auto.value >= fixed.value * (1 - auto.config["tol"]), (auto.value, fixed.value)


def test_one_start_is_not_certified_however_stationary():
    """The verdict itself: a stationary best point (gap 0) of one start is NOT_CERTIFIED, with two agreeing
    stationary starts CERTIFIED."""
    one = SolveResult(1.5, 1.0, gap=0.0, start_values=[0.5], start_gaps=[0.0], start_kinds=["zero"])
    state, note = one.verdict(1e-3, starts=1)
    assert state == NOT_CERTIFIED and "fixed budget" in note
    two = SolveResult(1.5, 1.0, gap=0.0, start_values=[0.5, 0.4999], start_gaps=[0.0, 1e-4],
                      start_kinds=["zero", "antipode"])
    assert two.verdict(1e-3, starts=2) == (CERTIFIED, None)
