"""The reduced group of RoPE models: its Lie algebra is exactly the commutant of HF's rotary rotations."""

from __future__ import annotations

import pytest
import torch

from hf_geosharp.engine.geometry.lie import random_group_element, rope_commutant_basis


def _rotation(head_dim: int, rotary_dim: int, position: float, interleaved: bool) -> torch.Tensor:
    """The matrix R with ``rope(q) = q @ R`` for row vectors q, built by HF's own rotary code (Llama or GPT-J)."""
    eye = torch.eye(head_dim, dtype=torch.float64)[None, None]  # [1, 1, h, h]: rows are the unit vectors
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = position * inv_freq
    rot, rest = eye[..., :rotary_dim], eye[..., rotary_dim:]
    if interleaved:
        from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb

        out = apply_rotary_pos_emb(rot.transpose(1, 2), angles.sin()[None, None], angles.cos()[None, None])
        out = out.transpose(1, 2)
    else:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cos, sin = torch.cat([angles, angles]).cos()[None, None], torch.cat([angles, angles]).sin()[None, None]
        out, _ = apply_rotary_pos_emb(rot, rot, cos, sin, unsqueeze_dim=1)
    return torch.cat([out, rest], dim=-1)[0, 0]


@pytest.mark.parametrize("head_dim,rotary_dim,interleaved", [(8, 8, False), (8, 4, False), (6, 2, False),
                                                            (8, 4, True), (4, 4, True)])
def test_basis_is_orthonormal_and_spans_exactly_the_commutant(head_dim, rotary_dim, interleaved):
    basis = rope_commutant_basis(head_dim, rotary_dim, interleaved=interleaved)
    gram = torch.einsum("aij,bij->ab", basis, basis)
    assert torch.allclose(gram, torch.eye(basis.shape[0], dtype=torch.float64), atol=1e-14)

    rotations = [_rotation(head_dim, rotary_dim, p, interleaved) for p in (1.0, 2.7, 5.0)]
    # every basis element commutes with the rotations ...
    for r in rotations:
        assert (basis @ r - r @ basis).abs().max() < 1e-12
    # ... and nothing else does: the commutant's dimension, computed from HF's rotations, equals the basis size
    h2 = head_dim * head_dim
    eye = torch.eye(head_dim, dtype=torch.float64)
    # column-major vec(X R - R X) = (R^T kron I - I kron R) vec(X)
    constraints = torch.cat([torch.kron(r.T.contiguous(), eye) - torch.kron(eye, r) for r in rotations])
    null_dim = h2 - int(torch.linalg.matrix_rank(constraints, rtol=1e-10))
    assert null_dim == basis.shape[0]


def test_basis_rejects_odd_or_oversized_rotary_dims():
    for rotary_dim in (3, 0, 10):
        with pytest.raises(ValueError, match="rotary_dim"):
            rope_commutant_basis(8, rotary_dim)


@pytest.mark.parametrize("condition", [1.0, 10.0, 100.0])
def test_random_element_has_the_requested_condition_number(condition):
    a = random_group_element(5, 6, scale=2.0, condition=condition, generator=torch.Generator().manual_seed(0))
    sv = torch.linalg.svdvals(a)
    assert torch.allclose(sv[:, 0] / sv[:, -1], torch.full((5,), condition, dtype=torch.float64), rtol=1e-8)
    assert torch.allclose((sv[:, 0] * sv[:, -1]).sqrt(), torch.full((5,), 2.0, dtype=torch.float64), rtol=1e-8)


def test_random_element_of_the_rope_subgroup_commutes_with_the_rotations():
    basis = rope_commutant_basis(8, 4)
    a = random_group_element(3, 8, lie_basis=basis, condition=50.0, generator=torch.Generator().manual_seed(1))
    r = _rotation(8, 4, 3.3, interleaved=False)
    assert (a @ r - r @ a).abs().max() < 1e-10
    sv = torch.linalg.svdvals(a)
    assert torch.allclose(sv[:, 0] / sv[:, -1], torch.full((3,), 50.0, dtype=torch.float64), rtol=1e-8)
    assert not torch.allclose(a, a[:1].expand_as(a))  # independent elements per pair


def test_random_element_rejects_an_algebra_without_the_identity():
    only_rotation = rope_commutant_basis(2, 2)[1:]  # span{J}: no identity, no symmetric part
    with pytest.raises(ValueError, match="identity|algebra"):
        random_group_element(1, 2, lie_basis=only_rotation)
