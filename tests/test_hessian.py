"""The peers' measures (the Hessian's top eigenvalue and trace) against a dense Hessian, their error bars, the eager
attention they need, the model left as it was, and their lack of invariance under the attention symmetries."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from torch import nn

import hf_geosharp as gs
from hf_geosharp.engine.hessian import attention_implementations, eager_attention
from hf_geosharp.measures import Settings, key_of_engine_name, parse_measures, run_measure

from .fixtures.hf_models import one_thread, tiny_bert  # noqa: F401 (one torch thread)


class _Net(nn.Module):
    """A tiny classifier (99 parameters): small enough for a dense Hessian."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 12).double()
        self.b = nn.Linear(12, 3).double()

    def forward(self, x, labels):
        return {"loss": nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), labels)}


def _batches(n: int = 2, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(10, 4, generator=g, dtype=torch.float64),
             "labels": torch.randint(0, 3, (10,), generator=g)} for _ in range(n)]


def _dense(model: nn.Module, batch: dict, sign: float = 1.0) -> torch.Tensor:
    """The batch loss's full Hessian in the parameters (``sign * loss``), by torch.autograd.functional.hessian."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(w):
        tensors, offset = {}, 0
        for name, shape in zip(names, shapes):
            tensors[name] = w[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return sign * torch.func.functional_call(model, tensors, (), batch)["loss"]

    return torch.autograd.functional.hessian(loss, flat)


@pytest.fixture(scope="module")
def net():
    model, batches = _Net(), _batches()
    return model, batches, [_dense(model, b) for b in batches]


def test_top_eigenvalue_matches_the_dense_hessian_and_leaves_the_model_as_it_was(net):
    model, batches, dense = net
    model.train()
    model.a.weight.requires_grad_(False)
    model.b.bias.grad = torch.ones(3, dtype=torch.float64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        res = gs.hessian_top_eigenvalue(model, batches, tol=1e-12, max_iters=2000, progress=False)
        assert model.training and not model.a.weight.requires_grad and model.b.bias.requires_grad
        assert torch.equal(model.b.bias.grad, torch.ones(3, dtype=torch.float64)) and model.a.bias.grad is None
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    finally:
        model.eval()
        model.a.weight.requires_grad_(True)
        model.b.bias.grad = None
    top = [float(torch.linalg.eigvalsh(h)[-1]) for h in dense]
    assert res.per_batch == pytest.approx(top, rel=1e-6)
    assert res.value == pytest.approx(sum(top) / 2, rel=1e-6) and res.measure == "hessian_top_eigenvalue"
    assert res.converged and res.convergence_note is None and 1 < res.steps_used <= 2000
    assert res.config["max_relative_residual"] < 1e-4  # an eigenvalue lies within the residual
    assert res.stderr == pytest.approx(abs(top[0] - top[1]) / 2, rel=1e-5)  # two batches: half their distance


def test_a_negative_dominant_eigenvalue_still_gives_the_largest_one(net):
    """For ``-loss`` the eigenvalue of largest magnitude is negative; the shifted second iteration finds the largest
    (positive) one, not the dominant one."""
    model, batches, _ = net
    dense = _dense(model, batches[0], sign=-1.0)
    spectrum = torch.linalg.eigvalsh(dense)
    assert -spectrum[0] > spectrum[-1] > 0  # the dominant eigenvalue is the negative one
    res = gs.hessian_top_eigenvalue(model, batches[:1], tol=1e-10, max_iters=2000, progress=False,
                                    loss_fn=lambda m, b: -m(**b)["loss"])
    assert res.converged and res.value == pytest.approx(float(spectrum[-1]), rel=1e-6)


def test_lanczos_that_stops_early_says_it_is_not_converged(net):
    model, batches, _ = net
    with pytest.warns(gs.NotConvergedWarning, match="raise max_iters"):
        res = gs.hessian_top_eigenvalue(model, batches, max_iters=2, tol=1e-12, progress=False)
    assert not res.converged and "batch 0" in res.convergence_note
    assert res.steps_used == 2  # the search ran out of products: no check runs
    assert res.value <= max(float(torch.linalg.eigvalsh(h)[-1]) for h in net[2]) + 1e-12  # a lower bound
    assert "not certified" in res.convergence_note and res.certificate == "not_certified"
    assert "NOT converged" in str(res)
    with gs.api.collected_convergence_notes() as notes, warnings.catch_warnings():
        warnings.simplefilter("error")
        gs.hessian_top_eigenvalue(model, batches, max_iters=2, tol=1e-12, progress=False)
    assert len(notes) == 1 and "hessian_top_eigenvalue" in notes[0]


def test_exact_trace_matches_the_dense_hessian(net):
    model, batches, dense = net
    res = gs.hessian_trace(model, batches, n_samples=None, progress=False)
    exact = [float(h.trace()) for h in dense]
    assert res.per_batch == pytest.approx(exact, rel=1e-10)
    assert res.config["estimator"] == "exact" and res.converged and res.steps_used is None


def test_hutchinson_lies_within_its_error_bar_and_the_bar_covers_as_it_should(net):
    """One batch: the error bar is the sample standard error of the draws. Fixed seed: within 3 of them; over 30
    seeds of 20 samples the +-2 stderr interval covers the exact trace about 94 % of the time (Student's t, 19
    degrees of freedom; at least 25 of 30 asked), and the bar is not inflated (it misses at +-1 stderr about a
    third of the time; at least 3 of 30 asked)."""
    model, batches, dense = net
    exact = float(dense[0].trace())
    res = gs.hessian_trace(model, batches[:1], n_samples=20, seed=0, progress=False)
    assert res.stderr > 0 and abs(res.value - exact) <= 3 * res.stderr, (res.value, res.stderr, exact)
    assert res.config["estimator"] == "hutchinson" and res.config["n_samples"] == 20
    z = []
    for seed in range(30):
        r = gs.hessian_trace(model, batches[:1], n_samples=20, seed=seed, progress=False)
        z.append(abs(r.value - exact) / r.stderr)
    assert sum(x <= 2 for x in z) >= 25, sorted(z)
    assert sum(x > 1 for x in z) >= 3, sorted(z)
    again = gs.hessian_trace(model, batches[:1], n_samples=20, seed=0, progress=False)
    assert again.value == res.value  # seeded


def test_the_registry_runs_both_with_its_settings(net):
    model, batches, _ = net
    assert parse_measures("eigenvalue,trace") == ["hessian_top_eigenvalue", "hessian_trace"]
    assert key_of_engine_name("hessian_top_eigenvalue") == "hessian_top_eigenvalue"
    assert key_of_engine_name("hessian_trace") == "hessian_trace"
    settings = Settings(n_samples=5, seed=3)
    trace = run_measure("hessian_trace", model, batches, settings, progress=False, symmetry_map=None)
    assert trace.value == gs.hessian_trace(model, batches, n_samples=5, seed=3, progress=False).value
    top = run_measure("hessian_top_eigenvalue", model, batches, settings, progress=False)
    assert top.config["seed"] == 3 and top.measure == "hessian_top_eigenvalue"


def test_settings_are_checked_before_any_work(net):
    model, batches, _ = net
    with pytest.raises(ValueError, match="max_iters"):
        gs.hessian_top_eigenvalue(model, batches, max_iters=0)
    with pytest.raises(ValueError, match="tol"):
        gs.hessian_top_eigenvalue(model, batches, tol=2.0)
    with pytest.raises(ValueError, match="n_samples"):
        gs.hessian_trace(model, batches, n_samples=0)
    with pytest.raises(ValueError, match="params"):
        gs.hessian_trace(model, batches, params="some")


def _bert_batches(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, 5:] = 0
    return [{"input_ids": torch.randint(5, 100, (4, 8), generator=g), "attention_mask": mask,
             "labels": torch.randint(0, 2, (4,), generator=g)}]


def _bert(impl: str) -> nn.Module:
    model = tiny_bert().double()
    model.config._attn_implementation = impl
    return model


def test_sdpa_models_run_with_eager_attention_and_get_theirs_back():
    """SDPA has no double backward (on the CPU: "derivative ... not implemented"); the measures switch the config to
    eager for the call and restore every attribute of it; the number is the eager model's."""
    sdpa, eager, batches = _bert("sdpa"), _bert("eager"), _bert_batches()
    leaves = {n: p.detach().requires_grad_(True) for n, p in sdpa.named_parameters()}
    loss = torch.func.functional_call(sdpa, leaves, (), batches[0]).loss
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True, allow_unused=True)
    with pytest.raises(RuntimeError, match="derivative"):
        torch.autograd.grad([g for g in grads if g is not None],
                            [x for x, g in zip(leaves.values(), grads) if g is not None],
                            [torch.ones_like(g) for g in grads if g is not None], allow_unused=True)
    before = dict(vars(sdpa.config))
    assert {impl for _, impl in attention_implementations(sdpa).values()} == {"sdpa"}
    a = gs.hessian_trace(sdpa, batches, n_samples=3, progress=False)
    assert dict(vars(sdpa.config)) == before and sdpa.config._attn_implementation == "sdpa"
    b = gs.hessian_trace(eager, batches, n_samples=3, progress=False)
    assert a.value == pytest.approx(b.value, rel=1e-9) and math.isfinite(a.value)
    with pytest.raises(KeyboardInterrupt), eager_attention(sdpa) as switched:
        assert switched == ["sdpa"] and sdpa.config._attn_implementation == "eager"
        raise KeyboardInterrupt
    assert dict(vars(sdpa.config)) == before


class _FusedAttention(nn.Module):
    """Calls the fused kernel itself (no config to switch)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(4, 12)
        self.head = nn.Linear(4, 2)

    def forward(self, x, labels):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # [batch, 1 head, length, 4]
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return {"loss": nn.functional.cross_entropy(self.head(out.mean((1, 2))), labels)}


def test_a_model_that_calls_a_fused_kernel_itself_gets_an_error_naming_the_fix():
    model = _FusedAttention()
    batch = {"x": torch.randn(3, 5, 4), "labels": torch.tensor([0, 1, 1])}
    with pytest.raises(RuntimeError, match="attn_implementation='eager'"):
        gs.hessian_trace(model, [batch], n_samples=1, progress=False)
    assert all(p.grad is None for p in model.parameters())


def test_geodesic_sharpness_is_the_same_with_sdpa_and_eager_attention():
    """Gradient-only measures need no double backward: SDPA (float64 on the CPU) and eager give the same value.
    The tolerance, 1e-6 relative, covers the two kernels' different summation orders (about 1e-15 each)."""
    batches = _bert_batches()
    sdpa, eager = _bert("sdpa"), _bert("eager")
    a = gs.geodesic_sharpness(sdpa, batches, steps=3, progress=False)
    b = gs.geodesic_sharpness(eager, batches, steps=3, progress=False)
    assert sdpa.config._attn_implementation == "sdpa"
    assert a.value > 0 and a.value == pytest.approx(b.value, rel=1e-6, abs=0)


def test_the_hessian_measures_are_not_invariant_under_the_attention_symmetries():
    """``gs.reparametrize`` leaves the function and geodesic sharpness unchanged (1e-6) and moves the Hessian's top
    eigenvalue and exact trace many times over, here on the first layer's value weights (``params="trainable"``,
    1024 parameters: the exact trace stays cheap; a GL(h) element acts there as ``W_V -> W_V A`` and turns the
    Hessian's block into a congruent one). Both Lanczos runs are certified, with residuals far below the move."""
    model, batches = _bert("eager"), _bert_batches()
    moved = copy.deepcopy(model)
    gs.reparametrize(moved, condition=10.0, scale=4.0)
    with torch.no_grad():
        assert float(moved(**batches[0]).loss) == pytest.approx(float(model(**batches[0]).loss), rel=1e-10)
    geodesic = [gs.geodesic_sharpness(m, batches, steps=3, progress=False).value for m in (model, moved)]
    assert geodesic[0] > 0 and geodesic[1] == pytest.approx(geodesic[0], rel=1e-6)
    for m in (model, moved):
        for name, p in m.named_parameters():
            p.requires_grad_(name == "bert.encoder.layer.0.attention.self.value.weight")
    top = [gs.hessian_top_eigenvalue(m, batches, tol=1e-6, max_iters=300, params="trainable", progress=False)
           for m in (model, moved)]
    assert all(r.converged and r.config["max_relative_residual"] < 1e-2 for r in top)
    assert top[1].value / top[0].value > 5, [r.value for r in top]
    trace = [gs.hessian_trace(m, batches, n_samples=None, params="trainable", progress=False).value
             for m in (model, moved)]
    assert abs(trace[1] - trace[0]) > 0.5 * max(map(abs, trace)), trace


def test_the_cli_runs_both_by_their_short_names(tmp_path, capsys):
    """``geosharp run --measures eigenvalue,trace``: the table and the JSON carry both, an SDPA model included."""
    from hf_geosharp import cli

    from .fixtures.hf_models import save_text_model, write_csv

    model, data, out = save_text_model(tmp_path / "bert"), write_csv(tmp_path / "reviews.csv", 8), tmp_path / "o.json"
    code = cli.main(["run", "--model", str(model), "--dataset", str(data), "--n-examples", "4", "--batch-size", "4",
                     "--measures", "eigenvalue,trace", "--n-samples", "2", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["hessian_top_eigenvalue", "hessian_trace"]
    assert results["hessian_trace"]["config"]["n_samples"] == 2 and math.isfinite(results["hessian_trace"]["value"])
    assert "hessian_top_eigenvalue" in printed and "hessian_trace" in printed


class _Tied(nn.Module):
    """Input embedding and output projection share one weight (as language models tie them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(7, 4).double()
        self.mix = nn.Linear(4, 4).double()
        self.out = nn.Linear(4, 7, bias=False).double()
        self.out.weight = self.embed.weight

    def forward(self, ids, labels):
        logits = self.out(torch.tanh(self.mix(self.embed(ids))))
        return {"loss": nn.functional.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1))}


def test_tied_weights_are_one_parameter_with_both_uses_in_its_hessian():
    model = _Tied()
    g = torch.Generator().manual_seed(0)
    batch = {"ids": torch.randint(0, 7, (3, 5), generator=g), "labels": torch.randint(0, 7, (3, 5), generator=g)}
    dense = _dense(model, batch)  # functional_call ties the weights too
    assert dense.shape == (48, 48)  # 28 shared + 16 + 4: the tied weight once
    res = gs.hessian_trace(model, [batch], n_samples=None, progress=False)
    assert res.value == pytest.approx(float(dense.trace()), rel=1e-10)
    top = gs.hessian_top_eigenvalue(model, [batch], tol=1e-12, max_iters=3000, progress=False)
    assert top.value == pytest.approx(float(torch.linalg.eigvalsh(dense)[-1]), rel=1e-6)
    assert model.out.weight is model.embed.weight


class _Quadratic(nn.Module):
    """``L(w) = w^T A w / 2``: its Hessian is ``A`` whatever the batch."""

    def __init__(self, spectrum: torch.Tensor) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        q, _ = torch.linalg.qr(torch.randn(len(spectrum), len(spectrum), generator=g, dtype=torch.float64))
        self.register_buffer("A", q @ torch.diag(spectrum) @ q.T)
        self.w = nn.Parameter(torch.randn(len(spectrum), generator=g, dtype=torch.float64))

    def forward(self, x):
        return {"loss": 0.5 * self.w @ self.A @ self.w + 0 * x.sum()}


@pytest.mark.parametrize("seed, tol, rel", [(2, 1e-3, 1e-2), (3, 1e-3, 1e-2), (3, 1e-10, 1e-6)])
def test_a_spectrum_as_negative_as_positive_still_gives_the_largest_eigenvalue(seed, tol, rel):
    """``lambda_max = 1 = -lambda_min``: power iteration on ``H`` swings between their vectors while its Rayleigh
    quotient stands still (PyHessian's test stopped it between the two: 0.34 and 0.71 from these seeds' starts);
    Lanczos' largest Ritz value is 1 within tol, with a small residual."""
    spectrum = torch.cat([torch.tensor([1.0, -1.0], dtype=torch.float64), torch.linspace(-0.5, 0.5, 18,
                                                                                        dtype=torch.float64)])
    model = _Quadratic(spectrum)
    res = gs.hessian_top_eigenvalue(model, [{"x": torch.zeros(1)}], tol=tol, max_iters=3000, seed=seed,
                                    progress=False)
    assert res.converged and res.value == pytest.approx(1.0, rel=rel), (res.value, res.steps_used)
    assert res.config["max_relative_residual"] <= tol
