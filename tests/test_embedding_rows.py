"""The worst case holds only the embedding rows its batches look up (hf_geosharp.engine.model_function.embedding_rows).

Properties: the scan finds exactly the rows the batches use and leaves whole every weight that something other than
a lookup reads; the value with the rows left out equals the value with whole weights (the left-out rows have zero
gradient, so a zero-started solve never moves them); the model comes back bit-exact; a lookup of a row the scan did
not see is refused, not answered with a wrong row.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import hf_geosharp as gs
from hf_geosharp.engine import builder
from hf_geosharp.engine.model_function.embedding_rows import RowLookup, UsedRows, scan_used_rows
from hf_geosharp.engine.model_function.objective import default_loss
from hf_geosharp.engine.placement.single import SingleProcess
from hf_geosharp.engine.settings import RunSettings

from .fixtures import architectures
from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import assert_intact, snapshot, tiny_batches, tiny_bert

SOLVE = dict(rho=0.05, steps=8, progress=False)


def _whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measure with whole embedding weights: the reference."""
    monkeypatch.setattr(builder, "scan_used_rows", lambda *args, **kwargs: {})


def _used(model: nn.Module, batches: list, loss_fn=default_loss) -> dict[str, int]:
    """``{parameter name: rows held}`` of the default worst-case build."""
    _, objective = builder.build(model, RunSettings(0.05), SingleProcess(model), loss_fn, dict(enumerate(batches)))
    holding = objective.placement.holding
    return {holding.names[i]: u.rows.numel() for i, u in holding.rows.items()}


class TiedLM(nn.Module):
    """An embedding that also serves as the output layer (``F.linear`` reads every row), a second one that only
    lookups read, with a padding row, and a checkpointed (non-reentrant) middle."""

    def __init__(self, vocab: int = 40, dim: int = 6) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.extra = nn.Embedding(vocab, dim, padding_idx=0)
        self.mid = nn.Linear(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.extra(ids)
        h = checkpoint(lambda x: torch.tanh(self.mid(x)), h, use_reentrant=False)
        return F.linear(h, self.tokens.weight)


def _lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _lm(seed: int = 0) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    model = TiedLM().double().eval()
    with torch.no_grad():
        model.extra.weight[0].normal_()  # a non-zero padding row, which the metric lets move (but no gradient reaches)
    g = torch.Generator().manual_seed(seed)
    return model, [torch.randint(0, 12, (3, 7), generator=g) for _ in range(2)]  # ids 0..11 of 40, padding included


def test_scan_finds_the_rows_the_batches_use():
    model, batches = tiny_bert(), tiny_batches(2, rows=3, length=6)
    ids = torch.cat([b["input_ids"].reshape(-1) for b in batches]).unique()
    assert _used(model, batches) == {
        "bert.embeddings.word_embeddings.weight": ids.numel(),
        "bert.embeddings.position_embeddings.weight": 6,
        "bert.embeddings.token_type_embeddings.weight": 1,
    }
    names, params = zip(*model.named_parameters())
    used = scan_used_rows(dict(enumerate(params)), lambda: [default_loss(model, b) for b in batches])
    word = names.index("bert.embeddings.word_embeddings.weight")
    assert torch.equal(used[word].rows, ids)
    assert torch.equal(used[word].place[ids], torch.arange(ids.numel()))
    assert int((used[word].place >= 0).sum()) == ids.numel()


def test_weights_read_otherwise_stay_whole():
    model, batches = _lm()
    looked_up = torch.cat([b[:, :-1].reshape(-1) for b in batches]).unique().numel()
    assert _used(model, batches, _lm_loss) == {"extra.weight": looked_up}  # `tokens` is read by F.linear too
    capped = nn.Embedding(40, 6, max_norm=1.0).double()  # renormalises its weight in place: left whole
    assert scan_used_rows({0: capped.weight}, lambda: capped(torch.arange(5))) == {}


@pytest.mark.parametrize("measure", ["inv", "mix", "adaptive"])
def test_value_equals_whole_weights(measure, monkeypatch):
    model, batches = tiny_bert(), tiny_batches(2, rows=3, length=6)
    run = (lambda: gs.adaptive_sharpness(model, batches, **SOLVE)) if measure == "adaptive" else (
        lambda: gs.geodesic_sharpness(model, batches, metric=measure, **SOLVE))
    snap = snapshot(model)
    with warnings.catch_warnings():  # whether 8 steps certify is not this test's question
        warnings.simplefilter("ignore", gs.NotConvergedWarning)
        rows = run()
    assert_intact(model, snap)
    _whole(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gs.NotConvergedWarning)
        whole = run()
    assert whole.value != 0
    assert rows.per_batch == pytest.approx(whole.per_batch, rel=1e-12, abs=0)
    assert rows.per_batch_clean_loss == whole.per_batch_clean_loss


@pytest.mark.parametrize("name", ["t5", "bart", "llama_gqa", "gemma_mqa", "gpt2_conv1d", "deberta_v2_shared",
                                  "albert", "mha"])
def test_architectures_equal_whole_weights(name, monkeypatch):
    """Shared, scaled, tied, relative-position and bare-PyTorch embeddings: the same value either way."""
    tiny = architectures.build(name)
    snap = snapshot(tiny.model)
    rows = gs.adaptive_sharpness(tiny.model, [tiny.batch], rho=0.05, steps=4, progress=False)
    assert_intact(tiny.model, snap)
    _whole(monkeypatch)
    whole = gs.adaptive_sharpness(tiny.model, [tiny.batch], rho=0.05, steps=4, progress=False)
    assert whole.value != 0
    assert rows.value == pytest.approx(whole.value, rel=1e-10, abs=0)


def test_padding_checkpointing_and_tied_weights(monkeypatch):
    model, batches = _lm()
    snap = snapshot(model)
    rows = gs.adaptive_sharpness(model, batches, loss_fn=_lm_loss, **SOLVE)
    assert_intact(model, snap)
    _whole(monkeypatch)
    whole = gs.adaptive_sharpness(model, batches, loss_fn=_lm_loss, **SOLVE)
    assert whole.value > 0
    assert rows.per_batch == pytest.approx(whole.per_batch, rel=1e-12, abs=0)


def test_space_holds_only_the_used_rows():
    model, batches = tiny_bert(), tiny_batches(2, rows=3, length=6)
    space, objective = builder.build(model, RunSettings(0.05), SingleProcess(model), default_loss,
                                     dict(enumerate(batches)))
    holding = objective.placement.holding
    left_out = sum((p.shape[0] - holding.rows[i].rows.numel()) * p.shape[1]
                   for i, p in enumerate(holding.params) if i in holding.rows)
    assert left_out > 0
    assert space.numel == sum(p.numel() for p in model.parameters()) - left_out
    whole, _ = builder.build(model, RunSettings(0.05, mode="average"), SingleProcess(model), default_loss,
                             dict(enumerate(batches)))
    assert whole.numel == sum(p.numel() for p in model.parameters())  # the average case draws every coordinate


def test_lookup_of_an_unseen_row_is_refused():
    emb = nn.Embedding(10, 3).double()
    used = UsedRows.of(torch.tensor([1, 4]), 10)
    rows = emb.weight.detach()[used.rows].clone()
    with RowLookup({id(emb.weight): (used, rows)}):
        assert torch.equal(emb(torch.tensor([4, 1, 4])), rows[[1, 0, 1]])
        with pytest.raises(RuntimeError, match="did not see"):
            emb(torch.tensor([2]))
        with pytest.raises(RuntimeError, match="only lookups"):
            emb.weight.sum()


class _HeadLM(TiedLM):
    """``TiedLM`` whose output layer reads the tied weight through ``head(h, weight)``."""

    def __init__(self, head) -> None:
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.extra(ids)
        return self.head(torch.tanh(self.mid(h)), self.tokens.weight)


TIED_READS = {
    "F.linear": lambda h, W: F.linear(h, W),
    ".T": lambda h, W: h @ W.T,
    ".mT": lambda h, W: h @ W.mT,
    ".t()": lambda h, W: h @ W.t(),
    "matmul": lambda h, W: torch.matmul(h, W.transpose(0, 1)),
    "einsum": lambda h, W: torch.einsum("btd,vd->btv", h, W),
    "indexing": lambda h, W: h @ W[torch.arange(W.shape[0])].T,
    "view": lambda h, W: h @ W.view(-1, W.shape[1]).T,
    "slice": lambda h, W: h @ W[:, :].T,
}


@pytest.mark.parametrize("how", sorted(TIED_READS))
def test_a_tied_weight_read_any_way_stays_whole_and_the_value_is_the_untied_one(how, monkeypatch):
    """However the output layer reads the tied embedding (a view, a transpose property, an einsum), the scan keeps it
    whole: the value equals the one with whole weights and the one through ``F.linear`` (issue: ``.T`` was taken
    for a read of metadata, and the rows the loss used were never perturbed)."""
    def build(head):
        torch.manual_seed(0)
        return _HeadLM(head).double().eval()

    _, batches = _lm()
    model = build(TIED_READS[how])
    looked_up = torch.cat([b[:, :-1].reshape(-1) for b in batches]).unique().numel()
    assert _used(model, batches, _lm_loss) == {"extra.weight": looked_up}
    value = gs.adaptive_sharpness(model, batches, loss_fn=_lm_loss, **SOLVE).per_batch
    reference = gs.adaptive_sharpness(build(TIED_READS["F.linear"]), batches, loss_fn=_lm_loss, **SOLVE).per_batch
    _whole(monkeypatch)
    whole = gs.adaptive_sharpness(model, batches, loss_fn=_lm_loss, **SOLVE).per_batch
    assert min(value) > 0
    assert value == pytest.approx(whole, rel=1e-12, abs=0)
    assert value == pytest.approx(reference, rel=1e-10, abs=0)
