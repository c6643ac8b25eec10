"""The model-as-function layer (``hf_geosharp.engine.model_function.objective``) and the single-process placement: the
one wrapper around PyTorch's private ``_reparametrize_module``, pinned here, and the objective's gradient written over
its own perturbed weights, against a slow, obvious reference (``torch.func.functional_call`` and
``torch.autograd.grad``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from hf_geosharp.engine.model_function.objective import Objective, default_loss, measured_parameters
from hf_geosharp.engine.placement.base import Holding
from hf_geosharp.engine.placement.single import SingleProcess, reparametrized
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import tiny_bert


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight  # tied

    def forward(self, x):
        return self.b(self.a(x))


def test_reparametrized_swaps_for_the_block_only_and_restores_on_errors():
    model, x = Tied(), torch.randn(2, 3)
    weight = model.a.weight
    other = torch.eye(3, requires_grad=True)
    with reparametrized(model, {"a.weight": other}):
        assert model.a.weight is other and model.b.weight is other  # the tied use follows
        assert torch.equal(model(x), x)
        model(x).sum().backward()  # a backward inside the block reaches the swapped-in tensor, not the parameter
    assert other.grad is not None and weight.grad is None
    assert model.a.weight is weight and model.b.weight is weight
    with reparametrized(model, {"a.weight": other}, tie_weights=False):
        assert model.a.weight is other and model.b.weight is weight
    with pytest.raises(RuntimeError, match="boom"), reparametrized(model, {"a.weight": other}):
        raise RuntimeError("boom")
    assert model.a.weight is weight and model.b.weight is weight and isinstance(model.a.weight, nn.Parameter)


@pytest.mark.parametrize("metric", [None, "inv"])
def test_gradient_over_the_weights_equals_plain_autograd(metric):
    """The objective streams each parameter's gradient over that parameter's perturbed weights in one buffer; the
    result equals the gradient of the loss at the same point by plain autograd, and the model is left bit-exact."""
    model = tiny_bert()
    names, params = measured_parameters(model)
    blocks = map_symmetries(model).blocks if metric else []
    space = PerturbationSpace(params, blocks, SpaceOptions(metric=metric, second_order=False))
    placement = SingleProcess(model)
    placement.hold(Holding.whole(names, params), [])
    objective = Objective(model, space, placement, default_loss, rho=0.1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (3, 6), generator=g)
    objective.batch = dict(input_ids=ids, labels=torch.tensor([0, 1, 2]))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    xi = space.project(space.random_tangent_vector(g), 0.1)
    buffer = space.empty()
    loss, grad = objective(xi, True, out=buffer)
    assert grad is buffer
    point = {n: p.detach() + x.view_as(p) for n, p, x in zip(names, params, xi.split([p.numel() for p in params]))}
    leaves = {n: t.clone().requires_grad_(True) for n, t in point.items()}
    reference_loss = functional_call(model, leaves, args=(), kwargs=objective.batch).loss
    reference = torch.autograd.grad(reference_loss, list(leaves.values()), allow_unused=True)
    reference = torch.cat([(r if r is not None else torch.zeros_like(t)).reshape(-1)
                           for r, t in zip(reference, leaves.values())])
    assert loss == pytest.approx(float(reference_loss.detach()), rel=1e-12)
    assert torch.allclose(grad, reference, rtol=1e-10, atol=1e-14)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
