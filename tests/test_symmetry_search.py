"""The engine's group search on its own: its proxy against the obvious computation, and what the search returns.

The reference for the proxy is the definition, computed the slow way: transform a copy of the model with the group
element (:func:`apply_group_elements`, the same action ``hide`` applies), take the loss's gradient there by autograd,
and form ``rho * ||grad L (.) |w| ||`` over every parameter, averaged over the batches. The proxy itself never
transforms the model; it moves one gradient taken at the original point covariantly.
"""

from __future__ import annotations

import ast
import copy
import math
from pathlib import Path

import pytest
import torch

from hf_geosharp import map_symmetries
from hf_geosharp.engine import symmetry_search
from hf_geosharp.engine.model_function.objective import default_loss
from hf_geosharp.engine.symmetry_search import AdaptiveProxy, search_group_element
from hf_geosharp.symmetry.base import SymmetryMap
from hf_geosharp.symmetry.group_action import apply_group_elements
from tests.fixtures.architectures import build
from tests.fixtures.intact import assert_intact, snapshot
from tests.fixtures.toy import ToyAttention, toy_batches, toy_symmetry_map

RHO = 0.05


def _first_order_worst_case(model: torch.nn.Module, batches: list) -> float:
    """``rho * ||grad L (.) |w| ||_2`` over all parameters, batch mean, by autograd on a copy of ``model`` (eval mode,
    every parameter differentiated)."""
    model = copy.deepcopy(model).eval()
    params = [p.requires_grad_(True) for p in model.parameters()]
    values = []
    for batch in batches:
        grads = torch.autograd.grad(default_loss(model, batch), params)
        square = sum(float(((g * p.detach().abs()) ** 2).sum()) for g, p in zip(grads, params))
        values.append(RHO * math.sqrt(square))
    return sum(values) / len(values)


def _moved(model: torch.nn.Module, smap: SymmetryMap, elements: list[torch.Tensor]) -> torch.nn.Module:
    moved = copy.deepcopy(model)
    apply_group_elements(moved, smap, elements)
    return moved


def _toy() -> tuple[ToyAttention, SymmetryMap, list]:
    model = ToyAttention().eval()
    return model, toy_symmetry_map(model), toy_batches()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_proxy_at_a_transformed_point_is_the_first_order_worst_case_there(seed: int) -> None:
    model, smap, batches = _toy()
    g = torch.Generator().manual_seed(seed)
    xs = [0.7 * torch.randn(b.n_pairs, b.head_dim, b.head_dim, generator=g, dtype=torch.float64) for b in smap.blocks]
    proxy = AdaptiveProxy(model, batches, smap, RHO, default_loss)
    identity = [torch.zeros_like(x) for x in xs]
    assert float(proxy(identity)) == pytest.approx(_first_order_worst_case(model, batches), rel=1e-10, abs=0)
    moved = _moved(model, smap, [torch.linalg.matrix_exp(x) for x in xs])
    expected = _first_order_worst_case(moved, batches)
    assert float(proxy(xs)) == pytest.approx(expected, rel=1e-10, abs=0)
    assert expected != pytest.approx(float(proxy(identity)), rel=1e-2)  # the point really moved the measure


def test_proxy_gradient_is_the_derivative_of_its_value() -> None:
    """The search follows ``d proxy / d X``: checked against finite differences."""
    model, smap, batches = _toy()
    g = torch.Generator().manual_seed(0)
    xs = tuple((0.3 * torch.randn(b.n_pairs, b.head_dim, b.head_dim, generator=g, dtype=torch.float64))
               .requires_grad_(True) for b in smap.blocks)
    proxy = AdaptiveProxy(model, batches, smap, RHO, default_loss)
    assert torch.autograd.gradcheck(lambda *x: proxy(list(x)), xs)


@pytest.mark.parametrize("target", ["sharp", "flat"])
def test_search_moves_the_proxy_and_reports_what_it_found(target: str) -> None:
    model, smap, batches = _toy()
    model.train()
    model.head.weight.grad = torch.ones_like(model.head.weight)
    model.embed.weight.requires_grad_(False)
    before = snapshot(model)
    found = search_group_element(model, batches, smap, target, rho=RHO, condition=100.0, search_steps=40, restarts=1,
                                 seed=0)
    assert_intact(model, before)  # the search only reads the model
    assert found.proxy_before == pytest.approx(_first_order_worst_case(model, batches), rel=1e-10, abs=0)
    moved = _moved(model, smap, found.elements)
    assert found.proxy_after == pytest.approx(_first_order_worst_case(moved, batches), rel=1e-10, abs=0)
    if target == "sharp":
        assert found.proxy_after > 1.5 * found.proxy_before
    else:
        assert found.proxy_after < found.proxy_before
    conditions = [float(torch.linalg.cond(a).max()) for a in found.elements]
    assert found.max_condition == max(conditions) <= 100.0 * (1 + 1e-9)
    assert [a.shape for a in found.elements] == [(b.n_pairs, b.head_dim, b.head_dim) for b in smap.blocks]


def test_search_is_seeded_and_more_restarts_never_do_worse() -> None:
    model, smap, batches = _toy()
    options = dict(rho=RHO, condition=100.0, search_steps=10, seed=3)
    one = search_group_element(model, batches, smap, "sharp", restarts=1, **options)
    again = search_group_element(model, batches, smap, "sharp", restarts=1, **options)
    assert all(torch.equal(a, b) for a, b in zip(one.elements, again.elements))
    assert one.proxy_after == again.proxy_after
    three = search_group_element(model, batches, smap, "sharp", restarts=3, **options)
    assert three.proxy_after >= one.proxy_after  # the first start is the same draw
    other = search_group_element(model, batches, smap, "sharp", restarts=1, **{**options, "seed": 4})
    assert not torch.equal(other.elements[0], one.elements[0])


def test_search_stays_in_the_subgroup_of_a_rope_model() -> None:
    """Partial RoPE: the query/key pairs only have the commutant of the rotations; an element outside it would change
    the outputs."""
    tiny = build("phi_partial")
    smap = map_symmetries(tiny.model)
    assert any(b.lie_basis is not None for b in smap.blocks)
    found = search_group_element(tiny.model, [tiny.batch], smap, "sharp", rho=RHO, condition=100.0, search_steps=10,
                                 restarts=1, seed=0)
    with torch.no_grad():
        logits = tiny.model(**tiny.batch).logits
        moved = _moved(tiny.model, smap, found.elements)(**tiny.batch).logits
    assert (moved - logits).abs().max() <= 1e-10 * logits.abs().max()
    assert found.proxy_after > found.proxy_before


def test_search_refuses_bad_arguments_before_any_work() -> None:
    model, smap, batches = _toy()
    before = snapshot(model)
    options = dict(rho=RHO, condition=100.0, search_steps=5, restarts=1, seed=0)
    cases = [("round", {}, smap, batches, "target"), ("sharp", {"condition": 0.5}, smap, batches, "condition"),
             ("sharp", {"condition": math.inf}, smap, batches, "condition"),
             ("sharp", {"search_steps": -1}, smap, batches, "search_steps"),
             ("sharp", {"restarts": 0}, smap, batches, "restarts"), ("sharp", {}, smap, [], "at least one batch"),
             ("sharp", {}, SymmetryMap.empty(model), batches, "no mapped attention symmetries")]
    for target, change, symmetry_map, data, message in cases:
        with pytest.raises(ValueError, match=message):
            search_group_element(model, data, symmetry_map, target, **{**options, **change})
    assert_intact(model, before)


def test_the_search_imports_nothing_from_the_faces() -> None:
    """The engine's search may use the engine and the symmetry map, never a face (the bundle, hide, leaderboard)."""
    tree = ast.parse(Path(symmetry_search.__file__).read_text())
    relative = [(node.level, node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.level]
    absolute = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level]
    assert all(level == 1 or module.startswith("symmetry.") for level, module in relative), relative
    assert not [m for m in absolute if m.startswith("hf_geosharp")], absolute
