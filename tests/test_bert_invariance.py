"""Invariance on a real attention model.

On a small BERT built from a config (fp64, ``epsilon=0``), a random GL(h) element applied to every QK and VO head pair
(condition number 100; function unchanged to 1e-10) leaves geodesic sharpness (inv and mix, worst and average case,
same seed) unchanged to 1e-6 relative, while adaptive sharpness visibly changes.

The model is left in *training* mode with BERT's default dropout (0.1): the measures must switch to eval mode
themselves (any dropout would make the numbers random and the invariance fail) and restore training mode afterwards.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import hf_geosharp as gs

LAYERS, HEADS, HIDDEN = 2, 4, 32  # head dim h = 8
HEAD_DIM = HIDDEN // HEADS
VOCAB, SEQ, BATCH = 50, 8, 3
CONDITION = 100.0
COMMON = dict(rho=0.05, steps=3, n_samples=3, seed=0, progress=False)


def _bert() -> tf.BertForSequenceClassification:
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           intermediate_size=48, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
                           attn_implementation="eager")
    assert config.hidden_dropout_prob > 0 and config.attention_probs_dropout_prob > 0  # defaults (0.1) kept
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(config).double()
    # BERT's 0.02 init makes attention nearly uniform and biases zero, which would hide a wrong map: draw larger
    # weights (and nonzero biases, which enter the pairs as an extra row of G)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    model.train()  # as a user would hand it over mid-training
    return model


def _batches() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[0, -3:] = 0  # some padding: the mask path runs too
        out.append({
            "input_ids": torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen),
            "token_type_ids": torch.randint(0, 2, (BATCH, SEQ), generator=gen),
            "attention_mask": mask,
            "labels": torch.randint(0, 3, (BATCH,), generator=gen),
        })
    return out


def _outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Loss, logits, every hidden state and every attention map, computed in eval mode (training mode restored)."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(**batch, output_hidden_states=True, output_attentions=True)
    finally:
        model.train(training)
    return [out.loss, out.logits, *out.hidden_states, *out.attentions]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def models():
    """The model and a copy transformed by ``gs.reparametrize(condition=100)``; checked to compute the same function."""
    model = _bert()
    moved = copy.deepcopy(model)
    smap = gs.map_symmetries(moved)
    applied = gs.reparametrize(moved, condition=CONDITION)
    assert moved.training  # reparametrize does not touch the mode

    # every QK and VO head pair is mapped onto the full GL(h) and nothing is left elementwise
    assert not smap.fallbacks
    assert sorted(b.kind for b in smap.blocks) == ["qk"] * LAYERS + ["vo"] * LAYERS
    assert all(b.n_pairs == HEADS and b.head_dim == HEAD_DIM and b.lie_basis is None for b in smap.blocks)
    conds = torch.linalg.cond(torch.cat(applied))
    assert conds.shape == (2 * LAYERS * HEADS,) and torch.allclose(conds, torch.full_like(conds, CONDITION), rtol=1e-8)
    return model, moved


def test_reparametrized_bert_computes_the_same_function_with_moved_weights(models):
    model, moved = models
    for batch in _batches():
        for before, after in zip(_outputs(model, batch), _outputs(moved, batch)):
            assert _rel(after, before) <= 1e-10
    # the weights really moved: every q/k/v/o weight and q/k/v bias changed by a lot (not round-off), nothing else
    before, after = dict(model.named_parameters()), dict(moved.named_parameters())
    attention = {f"bert.encoder.layer.{layer}.attention.{name}" for layer in range(LAYERS) for name in (
        "self.query.weight", "self.query.bias", "self.key.weight", "self.key.bias", "self.value.weight",
        "self.value.bias", "output.dense.weight")}
    for name in attention:
        assert _rel(after[name], before[name]) > 0.5, name
    assert {n for n in before if not torch.equal(before[n], after[n])} == attention


@pytest.mark.parametrize("mode", ["worst", "average"])
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_geodesic_sharpness_is_invariant_and_adaptive_is_not(models, metric, mode):
    model, moved = models
    batches = _batches()
    state = {n: p.clone() for n, p in model.state_dict().items()}

    geodesic = [gs.geodesic_sharpness(m, batches, metric=metric, mode=mode, epsilon=0.0, **COMMON) for m in models]
    adaptive = [gs.adaptive_sharpness(m, batches, mode=mode, **COMMON).value for m in models]

    before, after = geodesic
    # the worst case is >= 0 by construction (xi = 0 is feasible); the average over random directions of a model at
    # random initialisation may have either sign, and must just be a real measurement
    assert before.value > 0 if mode == "worst" else before.value != 0
    assert before.measure == f"geodesic_{metric}_{mode}"
    assert after.clean_loss == pytest.approx(before.clean_loss, rel=1e-10)
    assert abs(after.value - before.value) <= 1e-6 * abs(before.value), (before.value, after.value)
    for b, a in zip(before.per_batch, after.per_batch):
        assert abs(a - b) <= 1e-6 * abs(b)
    assert abs(adaptive[1] - adaptive[0]) > 0.05 * abs(adaptive[0]), adaptive  # adaptive sharpness visibly changes

    # eval mode was used inside and training mode restored afterwards; the weights were not touched
    assert all(m.training for m in model.modules()) and all(m.training for m in moved.modules())
    assert all(torch.equal(p, state[n]) for n, p in model.state_dict().items())
