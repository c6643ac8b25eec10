"""The Hessian's top eigenvalue and its certificate against dense Hessians: Lanczos on dense matrices (thick
restarts, deflation), and ``gs.hessian_top_eigenvalue`` on tiny float64 transformers (an encoder whose negative end
dominates, a decoder), quadratics with a dominant negative end and a near-degenerate top, and a search that misses
the top: certified means within tol of the dense top eigenvalue; too few products say not certified."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import hf_geosharp as gs
from hf_geosharp.engine import hessian as hessian_module
from hf_geosharp.engine.lanczos import KRYLOV_DIM, lanczos

from .fixtures.hf_models import one_thread  # noqa: F401 (one torch thread)


def _symmetric(spectrum: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(spectrum), len(spectrum), generator=g, dtype=torch.float64))
    return q @ torch.diag(spectrum) @ q.T


def test_lanczos_with_thick_restarts_finds_the_top_of_a_dense_matrix_within_its_residual():
    """200 eigenvalues, a basis of at most KRYLOV_DIM: the restarts keep the largest Ritz vectors, the residual
    estimate is the measured one, and an eigenvalue lies within it."""
    g = torch.Generator().manual_seed(1)
    spectrum = torch.randn(200, generator=g, dtype=torch.float64)
    a = _symmetric(spectrum)
    ritz = lanczos(lambda v: a @ v, torch.randn(200, generator=g, dtype=torch.float64), 400, 1e-10)
    assert ritz.settled and not ritz.invariant and KRYLOV_DIM < ritz.products < 400
    measured = float(torch.linalg.vector_norm(a @ ritz.vector - ritz.theta * ritz.vector))
    assert measured == pytest.approx(ritz.residual, rel=1e-3, abs=1e-12) and measured <= 1e-9
    assert abs(ritz.theta - float(spectrum.max())) <= measured and ritz.theta <= float(spectrum.max()) + 1e-12


def test_deflated_lanczos_finds_the_top_of_the_rest_and_an_invariant_space_is_exact():
    spectrum = torch.tensor([3.0, 2.0, 1.0, -4.0], dtype=torch.float64)
    a = _symmetric(spectrum)
    top = torch.linalg.eigh(a).eigenvectors[:, -1:].T
    g = torch.Generator().manual_seed(0)
    ritz = lanczos(lambda v: a @ v, torch.randn(4, generator=g, dtype=torch.float64), 50, 0.0,
                   deflate=top)
    assert ritz.invariant and ritz.theta == pytest.approx(2.0, abs=1e-12)  # three directions left: exact
    assert abs(float(top[0] @ ritz.vector)) < 1e-12
    above = lanczos(lambda v: a @ v, torch.randn(4, generator=g, dtype=torch.float64), 50, 0.0, above=0.5)
    assert not above.settled and above.theta > 0.5  # stops as soon as a Ritz value passes `above`


class _Quadratic(nn.Module):
    """``L(w) = w^T A w / 2``: its Hessian is ``A`` whatever the batch."""

    def __init__(self, spectrum: list[float], seed: int = 0) -> None:
        super().__init__()
        self.register_buffer("A", _symmetric(torch.tensor(spectrum, dtype=torch.float64), seed))
        self.w = nn.Parameter(torch.ones(len(spectrum), dtype=torch.float64))

    def forward(self, x):
        return {"loss": 0.5 * self.w @ self.A @ self.w + 0 * x.sum()}


_BATCH = [{"x": torch.zeros(1)}]


@pytest.mark.parametrize("spectrum", [
    [1.0, 0.5, -3.0],
    [1.0, 0.5, -3.0, *torch.linspace(-2.9, 0.45, 40).tolist()],  # the negative end dominates, a spread below
    [1.0, 0.9999, *torch.linspace(-1.0, 0.9, 60).tolist()],  # a near-degenerate top
])
@pytest.mark.parametrize("tol", [1e-3, 1e-6])
def test_quadratics_are_certified_only_within_tol_of_the_top_eigenvalue(spectrum, tol):
    res = gs.hessian_top_eigenvalue(_Quadratic(spectrum), _BATCH, tol=tol, progress=False)
    assert res.converged and res.certificate == "certified"
    assert res.config["max_relative_residual"] <= tol and res.config["estimator"] == "lanczos"
    assert max(spectrum) * (1 - tol) <= res.value <= max(spectrum) + 1e-12, res.value


def test_too_few_products_are_not_certified_and_give_a_lower_bound():
    spectrum = [1.0, 0.5, -3.0, *torch.linspace(-2.9, 0.45, 40).tolist()]
    with pytest.warns(gs.NotConvergedWarning, match="not certified"):
        res = gs.hessian_top_eigenvalue(_Quadratic(spectrum), _BATCH, max_iters=3, progress=False)
    assert not res.converged and res.certificate == "not_certified" and res.value < 1.0
    assert res.steps_used <= 2 * 3


class _Dense:
    """A batch Hessian given as a dense matrix; the first start vector has no component along the top
    eigenvector (a search from it cannot see the top), the later ones are Gaussian."""

    def __init__(self, a: torch.Tensor, blind: torch.Tensor) -> None:
        self.a, self.blind, self.products, self.starts = a, blind, 0, 0

    def flat(self, v: torch.Tensor) -> torch.Tensor:
        self.products += 1
        return self.a @ v

    def flat_random(self, generator: torch.Generator) -> torch.Tensor:
        self.starts += 1
        v = torch.randn(len(self.a), generator=generator, dtype=torch.float64)
        return v - (self.blind @ v) * self.blind if self.starts == 1 else v


def test_a_search_that_misses_the_top_is_caught_by_the_check_and_restarted():
    """The search settles on 2 (an eigenvalue, small residual) from a start blind to the top eigenvector; the check,
    from a fresh start kept orthogonal to the found vector, rises above 2, and the search restarts from its vector."""
    spectrum = torch.tensor([3.0, 2.0, *torch.linspace(-1.0, 1.5, 40).tolist()], dtype=torch.float64)
    a = _symmetric(spectrum)
    dense = _Dense(a, torch.linalg.eigh(a).eigenvectors[:, -1])
    value, products, certified, residual, why = hessian_module._top_eigenvalue(
        dense, torch.Generator().manual_seed(0), 100, 1e-3)
    assert certified and why == "" and value == pytest.approx(3.0, rel=1e-3) and residual <= 1e-3
    assert dense.starts >= 3  # search, check (found more), search again, check
    ones = torch.ones(42, dtype=torch.float64)
    first = lanczos(lambda v: a @ v, ones - (dense.blind @ ones) * dense.blind, 100, 1e-3)
    assert first.settled and first.theta == pytest.approx(2.0, rel=1e-3)  # what the search alone would certify


# ------------------------------------------------------------------------------------------------ tiny transformers
def _next_token_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """A decoder's loss in float64 (transformers' own casts the logits to float32: a Hessian symmetric to 1e-8)."""
    logits = model(input_ids=batch["input_ids"]).logits
    targets = batch["input_ids"][:, 1:].reshape(-1)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets)


def _classifier_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


class _Loss(nn.Module):
    def __init__(self, model: nn.Module, loss_fn) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: dict) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def _dense_top(model: nn.Module, batch: dict, loss_fn) -> float:
    """The dense Hessian's top eigenvalue: the unit vectors' products (batched), on the coordinates a random product
    touches (the others, e.g. unused embedding rows, are zero rows and columns of ``H``, eigenvalue 0)."""
    wrapper = _Loss(model, loss_fn)
    names = [n for n, _ in wrapper.named_parameters()]
    leaves = [p.detach().requires_grad_(True) for p in wrapper.parameters()]
    loss = torch.func.functional_call(wrapper, dict(zip(names, leaves)), (batch,))
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    flat = torch.cat([g.reshape(-1) for g in grads])
    probe = torch.randn(len(flat), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    touched = torch.nonzero(torch.cat([h.reshape(-1) for h in torch.autograd.grad(flat, leaves, probe,
                                                                                  retain_graph=True)])).flatten()
    rows = []
    for chunk in touched.split(256):
        units = torch.zeros(len(chunk), len(flat), dtype=torch.float64)
        units[torch.arange(len(chunk)), chunk] = 1.0
        hu = torch.autograd.grad(flat, leaves, units, retain_graph=True, is_grads_batched=True)
        rows.append(torch.cat([h.reshape(len(chunk), -1) for h in hu], 1)[:, touched])
    h = torch.cat(rows)
    assert torch.allclose(h, h.T, atol=1e-10)
    top = float(torch.linalg.eigvalsh((h + h.T) / 2)[-1])
    return max(top, 0.0) if len(touched) < len(flat) else top


def _tokens(vocab: int, labels: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 6), generator=g)
    return {"input_ids": ids, **({"labels": torch.randint(0, 2, (4,), generator=g)} if labels else {})}


def _bert() -> nn.Module:
    """An encoder whose Hessian's negative end dominates (lambda_min about -3.84, lambda_max 3.43, next 2.98)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                        vocab_size=30, attn_implementation="eager")
    return BertForSequenceClassification(config).double().eval()


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=30, n_positions=16, bos_token_id=0,
                        eos_token_id=0, attn_implementation="eager")
    return GPT2LMHeadModel(config).double().eval()


@pytest.mark.parametrize("build, loss_fn", [(_bert, _classifier_loss), (_gpt2, _next_token_loss)])
def test_tiny_transformers_are_certified_within_tol_of_the_dense_top_eigenvalue_at_the_defaults(build, loss_fn):
    model = build()
    batch = _tokens(30, loss_fn is _classifier_loss)
    top = _dense_top(model, batch, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gs.NotConvergedWarning)
        res = gs.hessian_top_eigenvalue(model, [batch], loss_fn=loss_fn, progress=False)
    assert res.converged and res.config["max_relative_residual"] <= res.config["tol"]
    assert top * (1 - res.config["tol"]) <= res.value <= top + 1e-9, (res.value, top, res.steps_used)
    tight = gs.hessian_top_eigenvalue(model, [batch], tol=1e-8, loss_fn=loss_fn, progress=False)
    assert tight.converged and tight.value == pytest.approx(top, rel=1e-8)
    assert math.isfinite(res.clean_loss)
