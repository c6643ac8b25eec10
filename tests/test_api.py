"""The public API on a tiny attention model: invariance, closed forms, restore guarantee, errors, determinism."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import hf_geosharp as gs
from hf_geosharp.symmetry.base import PairBlock, SymmetryMap

from .fixtures.toy import ToyAttention, reparametrize_toy, toy_batches, toy_symmetry_map

RHO = 0.05
COMMON = dict(steps=8, seed=0, progress=False)


def _snapshot(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [p.requires_grad for p in model.parameters()],
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        [m.training for m in model.modules()],
    )


def _assert_unchanged(model, snap):
    state, flags, grads, modes = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert [p.requires_grad for p in model.parameters()] == flags
    for p, g in zip(model.parameters(), grads):
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)
    assert [m.training for m in model.modules()] == modes


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize("mode", ["worst", "average"])
def test_geodesic_sharpness_is_invariant_under_attention_symmetries(metric, mode):
    model = ToyAttention()
    batches = toy_batches()
    twin = copy.deepcopy(model)
    reparametrize_toy(twin, toy_symmetry_map(twin), condition=100.0)
    moved = max((a - b).abs().max() for a, b in zip(model.parameters(), twin.parameters()))
    assert moved > 0.1
    with torch.no_grad():
        for b in batches:
            assert torch.allclose(model.eval()(**b)["logits"], twin.eval()(**b)["logits"], rtol=1e-10, atol=1e-12)
    kw = dict(rho=RHO, metric=metric, mode=mode, epsilon=0.0, n_samples=5, **COMMON)
    a = gs.geodesic_sharpness(model, batches, symmetry_map=toy_symmetry_map(model), **kw)
    b = gs.geodesic_sharpness(twin, batches, symmetry_map=toy_symmetry_map(twin), **kw)
    assert a.value > 0 if mode == "worst" else math.isfinite(a.value)
    assert b.value == pytest.approx(a.value, rel=1e-6)
    assert np.allclose(a.per_batch, b.per_batch, rtol=1e-6)

    ad_a = gs.adaptive_sharpness(model, batches, rho=RHO, mode=mode, n_samples=5, **COMMON)
    ad_b = gs.adaptive_sharpness(twin, batches, rho=RHO, mode=mode, n_samples=5, **COMMON)
    assert abs(ad_b.value - ad_a.value) > 0.05 * abs(ad_a.value)


def test_ablations_break_invariance_where_the_paper_says_they_should():
    model, batches = ToyAttention(), toy_batches()
    twin = copy.deepcopy(model)
    reparametrize_toy(twin, toy_symmetry_map(twin))
    kw = dict(rho=RHO, metric="inv", epsilon=0.0, riemannian_norm=False, **COMMON)
    a = gs.geodesic_sharpness(model, batches, symmetry_map=toy_symmetry_map(model), **kw)
    b = gs.geodesic_sharpness(twin, batches, symmetry_map=toy_symmetry_map(twin), **kw)
    assert abs(a.value - b.value) > 1e-3 * abs(a.value)


def _scalar_model(G0=1.3, H0=0.7):
    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.G = nn.Parameter(torch.tensor([[G0]], dtype=torch.float64))
            self.H = nn.Parameter(torch.tensor([[H0]], dtype=torch.float64))

        def forward(self, x, y):
            return {"loss": ((x * (self.G @ self.H.T)[0, 0] - y) ** 2).mean()}

    model = Scalar()
    smap = SymmetryMap.empty(model)
    smap.blocks = [PairBlock("linear", "scalar", torch.tensor([[[0]]]), torch.tensor([[[1]]]))]
    return model, smap


@pytest.mark.parametrize("y", [0.5, 2.0])
def test_scalar_toy_matches_closed_form(y):
    """docs/spec.md §2.6: n = h = 1, inv metric. Exp2 the horizontal curve is G(1 + b + b^2/2), ||xi|| = sqrt(2)|b|."""
    model, smap = _scalar_model()
    y0 = 1.3 * 0.7
    batch = [{"x": torch.tensor([1.0], dtype=torch.float64), "y": torch.tensor([y], dtype=torch.float64)}]
    values = {}
    for rho in (0.2, 0.1, 0.05):
        res = gs.geodesic_sharpness(model, batch, rho=rho, metric="inv", epsilon=0.0, steps=20, progress=False,
                                    symmetry_map=smap)
        b = np.linspace(-rho / np.sqrt(2), rho / np.sqrt(2), 200001)
        exp2 = np.max((y0 * (1 + b + b**2 / 2) ** 2 - y) ** 2) - (y0 - y) ** 2
        exact = np.max(y0**2 * (np.exp(4 * b) - 1) - 2 * y * y0 * (np.exp(2 * b) - 1))
        assert res.value == pytest.approx(exp2, rel=1e-6)
        values[rho] = abs(res.value - exact)
    # the second-order geodesic differs from the exact one by O(rho^3)
    assert values[0.2] / values[0.1] > 6 and values[0.1] / values[0.05] > 6


def test_restore_guarantee_after_success_with_train_mode_grads_and_frozen_params():
    model, batches = ToyAttention(), toy_batches()
    model.train()
    model.head.weight.grad = torch.ones_like(model.head.weight)
    model.norm.weight.requires_grad_(False)
    snap = _snapshot(model)
    gs.geodesic_sharpness(model, batches, rho=RHO, symmetry_map=toy_symmetry_map(model), **COMMON)
    gs.adaptive_sharpness(model, batches, rho=RHO, **COMMON)
    _assert_unchanged(model, snap)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_restore_guarantee_when_the_loss_raises_mid_solve(error):
    model, batches = ToyAttention(), toy_batches()
    model.train()
    snap = _snapshot(model)
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        if calls["n"] == 4:
            raise error("boom")
        return m(**batch)["loss"]

    with pytest.raises(error):
        gs.geodesic_sharpness(model, batches, rho=RHO, loss_fn=loss_fn, symmetry_map=toy_symmetry_map(model), **COMMON)
    _assert_unchanged(model, snap)


def test_all_parameters_frozen_still_works_and_keeps_flags():
    model, batches = ToyAttention(), toy_batches()
    for p in model.parameters():
        p.requires_grad_(False)
    res = gs.geodesic_sharpness(model, batches, rho=RHO, symmetry_map=toy_symmetry_map(model), **COMMON)
    assert res.value > 0
    assert not any(p.requires_grad for p in model.parameters())


def test_solver_runs_in_eval_mode_so_dropout_is_off():
    model, batches = ToyAttention(), toy_batches()
    model.train()
    a = gs.adaptive_sharpness(model, batches, rho=RHO, **COMMON)
    b = gs.adaptive_sharpness(model, batches, rho=RHO, **COMMON)
    assert a.value == b.value and model.training
    with torch.no_grad():
        assert a.clean_loss == pytest.approx(np.mean([model.eval()(**x)["loss"].item() for x in batches]), rel=1e-12)


def test_same_seed_same_result_bit_for_bit():
    model, batches = ToyAttention(), toy_batches()
    kw = dict(rho=RHO, mode="average", n_samples=4, symmetry_map=toy_symmetry_map(model), progress=False)
    def run(seed):
        return gs.geodesic_sharpness(model, batches, seed=seed, **kw)

    assert run(3).per_batch == run(3).per_batch
    assert run(3).value != run(4).value


def test_worst_case_stays_in_the_ball_and_beats_average_case():
    model, batches = ToyAttention(), toy_batches()
    smap = toy_symmetry_map(model)
    worst = gs.geodesic_sharpness(model, batches, rho=RHO, symmetry_map=smap, **COMMON)
    avg = gs.geodesic_sharpness(model, batches, rho=RHO, mode="average", symmetry_map=smap, **COMMON)
    assert worst.value > avg.value
    assert worst.clean_loss == pytest.approx(avg.clean_loss, rel=1e-12)


def test_half_precision_model_is_measured_in_float32():
    model = ToyAttention(dtype=torch.bfloat16)
    res = gs.adaptive_sharpness(model, toy_batches(dtype=torch.bfloat16), rho=RHO, **COMMON)
    assert math.isfinite(res.value)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, batches, match",
    [
        (dict(rho=0.0), None, "rho must be a positive"),
        (dict(rho=-1.0), None, "rho must be a positive"),
        (dict(rho=float("nan")), None, "rho must be a positive"),
        (dict(metric="euclid"), None, "metric must be"),
        (dict(mode="best"), None, "mode must be"),
        (dict(steps=0), None, "steps must be"),
        ({}, [], "No batches"),
        ({}, [{}], "Batch 0 is empty"),
    ],
)
def test_bad_arguments_get_clear_errors(kwargs, batches, match):
    model = ToyAttention()
    with pytest.raises(ValueError, match=match):
        gs.geodesic_sharpness(
            model, toy_batches() if batches is None else batches, symmetry_map=toy_symmetry_map(model),
            **{**COMMON, **kwargs},
        )


def test_missing_loss_and_non_finite_loss_are_explained():
    model = ToyAttention()
    batches = toy_batches()
    no_labels = [{"x": b["x"]} for b in batches]
    with pytest.raises(ValueError, match="returned no loss"):
        gs.adaptive_sharpness(model, no_labels, **COMMON)
    bad = [{"x": b["x"] * float("nan"), "labels": b["labels"]} for b in batches]
    with pytest.raises(FloatingPointError, match="unperturbed"):
        gs.adaptive_sharpness(model, bad, **COMMON)
    nan_model = ToyAttention()
    with torch.no_grad():
        nan_model.head.bias[0] = float("nan")
    with pytest.raises(ValueError, match="head.bias"):
        gs.adaptive_sharpness(nan_model, batches, **COMMON)


def test_symmetry_map_of_another_model_is_refused():
    with pytest.raises(ValueError, match="another model"):
        gs.geodesic_sharpness(ToyAttention(), toy_batches(), symmetry_map=SymmetryMap.empty(nn.Linear(2, 2)), **COMMON)


def test_as23_variant_reports_a_larger_or_equal_loss_increase_than_zero():
    model, batches = ToyAttention(), toy_batches()
    as23 = gs.adaptive_sharpness(model, batches, rho=RHO, variant="as23", **COMMON)
    clean = gs.adaptive_sharpness(model, batches, rho=RHO, variant="clean", **COMMON)
    assert as23.value > 0 and clean.value > 0
    assert as23.measure == "adaptive_as23_worst" and clean.measure == "adaptive_clean_worst"


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_objective_gradient_matches_finite_differences_through_exp2(metric):
    """The solver's gradient (streamed per-parameter gradients + closed-form Exp2 pullback) against a central difference
    of the loss along a random direction, at a perturbed point: the slow, obvious reference of the fast path.
    The LayerNorm bias starts at zero, so it is frozen and the direction leaves it alone."""
    from hf_geosharp.engine.model_function.objective import Objective, default_loss, measured_parameters
    from hf_geosharp.engine.placement.base import Holding
    from hf_geosharp.engine.placement.single import SingleProcess
    from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions

    model = ToyAttention().eval()
    names, params = measured_parameters(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in params])
    options = SpaceOptions(metric, 1e-6, elementwise_curvature="second_order")
    space = PerturbationSpace(params, toy_symmetry_map(model).blocks, options)
    placement = SingleProcess(model)
    placement.hold(Holding.whole(names, params), [])
    objective = Objective(model, space, placement, default_loss, rho=RHO)
    objective.batch = toy_batches()[0]
    g = torch.Generator().manual_seed(0)
    xi = space.project(space.random_tangent_vector(g), RHO)
    v = torch.randn(theta0.shape, generator=g, dtype=theta0.dtype) * space.movable  # frozen (zero) weights never move
    _, grad = objective(xi, True)
    t = 1e-5
    plus, _ = objective(xi + t * v, False)
    minus, _ = objective(xi - t * v, False)
    assert float(grad @ v) == pytest.approx((plus - minus) / (2 * t), rel=1e-6)


class _MLP(nn.Module):
    """A plain MLP: no attention, so nothing to quotient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x, labels):
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


def test_a_model_with_nothing_to_quotient_gets_one_note_per_call_from_every_entry_point(caplog):
    """Geodesic sharpness of a model without attention pairs is adaptive sharpness by construction; the API says so
    with one NoSymmetryWarning per call (not silently), run_measures (the CLI's, evaluate's and the Trainer's path)
    with one log line for all its measures, in the same words; a model with attention pairs gets no note."""
    import warnings

    from hf_geosharp.measures import no_symmetry_note, run_measures

    model = _MLP()
    torch.manual_seed(1)
    batches = [{"x": torch.randn(8, 4), "labels": torch.randint(0, 2, (8,))} for _ in range(2)]
    words = no_symmetry_note(gs.map_symmetries(model))
    assert words is not None and "no attention head pairs" in words
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        geodesic = gs.geodesic_sharpness(model, batches, rho=RHO, **COMMON)
        adaptive = gs.adaptive_sharpness(model, batches, rho=RHO, **COMMON)
    notes = [w for w in caught if issubclass(w.category, gs.api.NoSymmetryWarning)]
    assert [str(w.message) for w in notes] == [words]  # one, from the geodesic call only
    assert notes[0].filename == __file__  # it points at the caller's line
    assert geodesic.value == pytest.approx(adaptive.value, rel=1e-12)

    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING", logger="hf_geosharp"):
        warnings.simplefilter("always")
        run_measures(["geodesic_sharpness_inv", "geodesic_sharpness_mix"], model, batches, progress=False)
    assert not [w for w in caught if issubclass(w.category, gs.api.NoSymmetryWarning)]
    assert [r.getMessage() for r in caplog.records if "no attention head pairs" in r.getMessage()] == [words]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        toy = ToyAttention()
        gs.geodesic_sharpness(toy, toy_batches(), rho=RHO, symmetry_map=toy_symmetry_map(toy), **COMMON)
    assert not [w for w in caught if issubclass(w.category, gs.api.NoSymmetryWarning)]


def test_the_note_names_attention_that_could_not_be_mapped():
    """DiffLlama has attention, but its groupnorm breaks GL(h) on VO, so nothing is mapped: the note says which
    module was treated elementwise and why, not that the model has no attention."""
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    from hf_geosharp.api import no_symmetry_note

    config = DiffLlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)
    smap = gs.map_symmetries(DiffLlamaForCausalLM(config))
    note = no_symmetry_note(smap, "DiffLlama")
    assert note.startswith("DiffLlama has no attention head pairs that could be mapped (2 attention modules treated "
                           "elementwise; model.layers.0.self_attn: DiffLlamaAttention")
    assert note.endswith("so geodesic sharpness equals adaptive sharpness by construction.")


def test_a_symmetry_map_made_for_the_call_is_freed_before_the_solver_runs(monkeypatch):
    """The default call maps the model itself; the map's index maps (8 bytes per paired coordinate, 2 bytes per
    parameter of BERT-base) are read by the space and the breakdown and freed before the solver's vectors exist, so
    they do not count against the solve's memory goal."""
    from .fixtures.intact import tiny_batches, tiny_bert
    from .fixtures.map_lifetime import watch_maps

    watch = watch_maps(monkeypatch)
    model, batches = tiny_bert(), tiny_batches(n=1)
    result = gs.geodesic_sharpness(model, batches, rho=RHO, **COMMON)
    assert len(watch.made) == 1 and watch.alive == [[False]]
    assert result.breakdown is not None and result.breakdown.heads  # the breakdown still names the heads
    smap = watch.map(model)  # a map the caller passes stays the caller's
    gs.geodesic_sharpness(model, batches, rho=RHO, symmetry_map=smap, **COMMON)
    assert smap.blocks and smap.blocks[0].G_index.numel() > 0
