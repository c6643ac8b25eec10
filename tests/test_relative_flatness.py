"""Relative flatness (Petzka et al. 2021): the exact default and the Hutchinson option against a dense-Hessian
reference, and its invariance to the attention symmetries."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hf_geosharp as gs
from hf_geosharp.engine.relative_flatness import feature_layer, relative_flatness

from .fixtures.hf_models import tiny_bert


class _Net(nn.Module):
    """Features ``tanh(body x) / s`` (``s`` a fixed per-feature scale), then the linear head relative flatness reads."""

    def __init__(self, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(3, 5).double()
        self.head = nn.Linear(5, 4).double()
        self.register_buffer("s", torch.ones(5, dtype=torch.float64) if scale is None else scale)
        with torch.no_grad():
            self.head.weight.mul_(self.s)  # head columns * s: the function does not depend on s

    def features(self, x):
        return torch.tanh(self.body(x)) / self.s

    def forward(self, x, labels):
        logits = self.head(self.features(x))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _net_batches():
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(16, 3, generator=g, dtype=torch.float64),
             "labels": torch.randint(0, 4, (16,), generator=g)} for _ in range(2)]


def _exact(model: _Net, batches) -> float:
    """Mean over batches of sum_{s,s'} <w_s, w_s'> Tr(H_{s,s'}), from the dense Hessian in the head's weight."""
    W = model.head.weight.detach().clone()
    values = []
    for batch in batches:
        features = model.features(batch["x"]).detach()

        def loss_of(w, features=features, labels=batch["labels"]):
            return nn.functional.cross_entropy(nn.functional.linear(features, w, model.head.bias), labels)

        H = torch.autograd.functional.hessian(loss_of, W)  # [m, d, m, d]
        values.append(float(((W @ W.T) * torch.einsum("aibi->ab", H)).sum()))
    return sum(values) / len(values)


def test_the_default_is_the_exact_trace_of_the_dense_hessian():
    model, batches = _Net(), _net_batches()
    res = relative_flatness(model, batches)
    assert res.config["estimator"] == "exact" and res.config["n_samples"] is None
    assert res.value == pytest.approx(_exact(model, batches), rel=1e-12)
    per = torch.tensor(res.per_batch, dtype=torch.float64)
    assert res.stderr == pytest.approx(float(per.std() / 2 ** 0.5), rel=1e-12)  # over the batches alone


def test_the_exact_trace_on_a_bert_classifier_equals_the_dense_hessian():
    """A real feature path (a tiny fp64 BERT with a 3-label head) against the Hessian of the loss in the head's
    weight, computed densely through a stateless call."""
    from torch.func import functional_call

    model = tiny_bert(num_labels=3).double().eval()
    g = torch.Generator().manual_seed(2)
    batches = [{"input_ids": torch.randint(5, 100, (4, 7), generator=g), "labels": torch.randint(0, 3, (4,),
                                                                                                     generator=g)}
               for _ in range(2)]
    W = model.classifier.weight.detach().clone()
    dense = []
    for batch in batches:
        H = torch.autograd.functional.hessian(
            lambda w, batch=batch: functional_call(model, {"classifier.weight": w}, kwargs=batch).loss, W)
        dense.append(float(((W @ W.T) * torch.einsum("aibi->ab", H)).sum()))
    res = relative_flatness(model, batches)
    assert res.per_batch == pytest.approx(dense, rel=1e-10)
    assert min(dense) > 0


def test_hutchinson_estimate_matches_the_dense_hessian_within_its_standard_error():
    model, batches = _Net(), _net_batches()[:1]  # one batch: the standard error is the Monte Carlo error alone
    exact = _exact(model, batches)
    res = relative_flatness(model, batches, n_samples=400, seed=0)
    assert res.measure == "relative_flatness" and res.config["layer"] == "head"
    assert 0 < res.stderr < 0.2 * abs(exact)
    assert abs(res.value - exact) <= 3 * res.stderr, (res.value, exact, res.stderr)
    again = relative_flatness(model, batches, n_samples=400, seed=0)
    assert again.value == res.value  # seeded
    assert relative_flatness(model, batches, n_samples=400, seed=1).value != res.value


def test_model_is_untouched_and_default_layer_is_the_classifier():
    model = tiny_bert().double()
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    name, module = feature_layer(model)
    assert name == "classifier" and module is model.classifier
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(5, 100, (4, 8), generator=g),
                "labels": torch.randint(0, 2, (4,), generator=g)}]
    res = relative_flatness(model, batches, n_samples=4)
    assert res.value == res.value and model.training
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="not a module"):
        relative_flatness(model, batches, layer="nope")


def test_invariant_to_attention_symmetries_and_layerwise_rescaling_but_not_per_feature_rescaling():
    """``gs.reparametrize`` moves the attention weights and leaves the features and the classifier unchanged, so
    kappa_Tr is unchanged. Moving a scale between the features and the head's columns leaves the function
    unchanged; kappa_Tr is invariant when the scale is one number for the layer, not when it differs per feature."""
    model = tiny_bert().double()
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(5, 100, (4, 8), generator=g),
                "labels": torch.randint(0, 2, (4,), generator=g)}]
    moved = copy.deepcopy(model)
    gs.reparametrize(moved, condition=100.0)
    assert not torch.equal(moved.bert.encoder.layer[0].attention.self.query.weight,
                           model.bert.encoder.layer[0].attention.self.query.weight)
    a, b = relative_flatness(model, batches, n_samples=8), relative_flatness(moved, batches, n_samples=8)
    assert b.value == pytest.approx(a.value, rel=1e-7)

    nb = _net_batches()
    net, layerwise = _Net(), _Net(torch.full((5,), 4.0, dtype=torch.float64))
    neuronwise = _Net(torch.tensor([0.2, 1.0, 5.0, 1.0, 3.0], dtype=torch.float64))
    for twin in (layerwise, neuronwise):
        for batch in nb:
            assert torch.allclose(twin(**batch)["logits"], net(**batch)["logits"], atol=1e-12)
    ref = _exact(net, nb)
    assert _exact(layerwise, nb) == pytest.approx(ref, rel=1e-10)
    assert abs(_exact(neuronwise, nb) - ref) > 0.05 * abs(ref)
    # the estimator inherits the layer-wise invariance sample by sample (same draws, scaled consistently)
    est = relative_flatness(net, nb, n_samples=16).value
    assert relative_flatness(layerwise, nb, n_samples=16).value == pytest.approx(est, rel=1e-10)
