"""Rows that were never batched (a ``datasets.Dataset``, a DataLoader without a collate function for them, a list of
single examples) are refused before the model runs once, with the fix; the fix the message gives works."""

from __future__ import annotations

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

import hf_geosharp as gs

from .fixtures.hf_models import one_thread, tiny_bert  # noqa: F401


def _rows(n: int = 8, ragged: bool = False) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    lengths = [6 + (i % 3 if ragged else 0) for i in range(n)]
    return datasets.Dataset.from_dict({
        "input_ids": [torch.randint(0, 100, (k,), generator=g).tolist() for k in lengths],
        "labels": [i % 2 for i in range(n)],
    })


@pytest.fixture
def counted():
    """A tiny BERT that counts its forward passes."""
    model = tiny_bert()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return model, calls


CASES = {
    "a datasets.Dataset": (lambda: _rows(), TypeError, "datasets.Dataset, whose items are single rows"),
    "a DataLoader without a collate_fn": (lambda: DataLoader(_rows(), batch_size=4), ValueError, "is not collated"),
    "a DataLoader over rows of different lengths": (lambda: DataLoader(_rows(ragged=True), batch_size=4), ValueError,
                                                    "could not be stacked"),
    "a list of rows": (lambda: list(_rows()), ValueError, "is not collated: 'input_ids' is a list"),
    "a list of single examples as tensors": (lambda: list(_rows().with_format("torch")), ValueError,
                                             "is one example"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("measure", [gs.geodesic_sharpness, gs.adaptive_sharpness, gs.hessian_trace])
def test_unbatched_rows_are_refused_before_any_forward_with_the_fix(case, measure, counted):
    model, calls = counted
    make, error, words = CASES[case]
    with pytest.raises(error, match=words) as raised:
        measure(model, make(), progress=False)
    assert "with_format('torch').iter(batch_size=8)" in str(raised.value)
    assert "DataCollatorWithPadding" in str(raised.value)
    assert not calls, "the model ran before the batches were refused"


def test_the_fix_the_message_names_runs(counted):
    model, calls = counted
    batches = list(_rows().with_format("torch").iter(batch_size=4))
    res = gs.geodesic_sharpness(model, batches, steps=2, progress=False)
    assert len(res.per_batch) == 2 and res.value >= 0 and calls


def test_a_loss_fn_takes_any_batch():
    """With ``loss_fn`` the batch is the caller's: a list inside it is not refused."""
    model = torch.nn.Linear(3, 1)
    batches = [{"x": [torch.ones(3), torch.zeros(3)], "y": torch.zeros(2, 1)}]

    def loss_fn(m, batch):
        return torch.nn.functional.mse_loss(m(torch.stack(batch["x"])), batch["y"])

    assert gs.adaptive_sharpness(model, batches, loss_fn=loss_fn, steps=1, progress=False).value >= 0
