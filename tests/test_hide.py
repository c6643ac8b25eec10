"""Hide & seek: ``gs.hide`` moves adaptive sharpness a lot along the symmetry group while the function and geodesic
sharpness stay put; the weights change all-or-nothing (``hide`` and ``reparametrize``), also under Ctrl-C.

The model is a tiny fp64 BERT with weights drawn at 0.2 (BERT's 0.02 init makes attention nearly uniform, and then
its query/key gradients, the only ones the group moves much, are negligible). Outputs and geodesic sharpness are
compared by the test itself, from forward passes before and after, not taken from ``hide``'s own report.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import signal
from pathlib import Path

import pytest
import torch
import transformers as tf

import hf_geosharp as gs
from hf_geosharp.hiding import FunctionChangedError, hide
from hf_geosharp.measures import run_measure
from hf_geosharp.symmetry.base import PairBlock

SETTINGS = dict(progress=False)
reparam_module = importlib.import_module("hf_geosharp.symmetry.group_action")  # the package re-exports the function


def _bert() -> tf.BertForSequenceClassification:
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, initializer_range=0.2)
    return tf.BertForSequenceClassification(config).eval().double()


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 100, (8, 16), generator=g), "labels": torch.randint(0, 2, (8,), generator=g)}
            for _ in range(2)]


def _logits(model: torch.nn.Module, batches: list) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in batches])


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_bit_exact(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def _geodesic(model: torch.nn.Module, batches: list) -> float:
    # default settings: the default relaxation epsilon transforms with the group, so it keeps the invariance
    return gs.geodesic_sharpness(model, batches, rho=0.1, metric="inv", steps=5, **SETTINGS).value


def _adaptive(model: torch.nn.Module, batches: list) -> float:
    return run_measure("adaptive_sharpness", model, batches, progress=False).value


@pytest.mark.parametrize("target", ["sharp", "flat"])
def test_hide_moves_adaptive_but_not_the_function_nor_geodesic(target: str) -> None:
    model, batches = _bert(), _batches()
    logits, adaptive, geodesic = _logits(model, batches), _adaptive(model, batches), _geodesic(model, batches)
    result = hide(model, batches, target=target, condition=1000.0, seed=0)
    after = _adaptive(model, batches)
    assert after == pytest.approx(result.value_after, rel=1e-12)  # hide reports the default measure's value
    factor = after / adaptive
    print(f"hide(target={target!r}): adaptive sharpness {adaptive:.4g} -> {after:.4g} (x{factor:.3g})")
    if target == "sharp":
        assert factor >= 10.0
    else:
        assert factor < 0.97
    assert (_logits(model, batches) - logits).abs().max() <= 1e-10 * logits.abs().max()
    assert _geodesic(model, batches) == pytest.approx(geodesic, rel=1e-4)
    assert result.max_condition <= 1000.0 * (1 + 1e-9)
    assert any(not torch.allclose(a, torch.eye(a.shape[-1], dtype=a.dtype)) for a in result.elements)


def test_hide_is_seeded_and_keeps_modes_flags_and_grads() -> None:
    batches = _batches()
    a, b = _bert(), _bert()
    a.train()
    a.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    a.classifier.weight.grad = torch.ones_like(a.classifier.weight)
    hide(a, batches, target="sharp", search_steps=20, evaluate=False)
    hide(b, batches, target="sharp", search_steps=20, evaluate=False)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.training and all(m.training for m in a.modules())
    assert not a.bert.embeddings.word_embeddings.weight.requires_grad
    assert torch.equal(a.classifier.weight.grad, torch.ones_like(a.classifier.weight))
    assert all(p.grad is None for n, p in a.named_parameters() if n != "classifier.weight")


def test_hide_refuses_bad_input_before_any_work() -> None:
    model, batches = _bert(), _batches()
    state = _state(model)
    with pytest.raises(ValueError, match="target"):
        hide(model, batches, target="round")
    with pytest.raises(ValueError, match="invariant"):
        hide(model, batches, measure="geodesic")
    with pytest.raises(ValueError, match="condition"):
        hide(model, batches, condition=0.5)
    _assert_bit_exact(model, state)


def test_hide_rolls_back_when_the_element_is_not_a_symmetry() -> None:
    """A map that pairs the query of layer 0 with the key of layer 1 is no symmetry: the probe catches it."""
    model, batches = _bert(), _batches()
    smap = gs.map_symmetries(model)
    wrong = PairBlock("qk", smap.blocks[0].module, smap.blocks[0].G_index, smap.blocks[2].H_index)
    bad = dataclasses.replace(smap, blocks=[wrong])
    state = _state(model)
    with pytest.raises(FunctionChangedError, match="restored"):
        hide(model, batches, target="sharp", symmetry_map=bad, search_steps=10, evaluate=False)
    _assert_bit_exact(model, state)


class _Interrupt:
    """Stands in for ``_copy``: copies, and on the ``at``-th write raises or delivers a real SIGINT."""

    def __init__(self, at: int, how: str) -> None:
        self.at, self.how, self.calls = at, how, 0
        self.copy = reparam_module._copy

    def __call__(self, param: torch.Tensor, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == self.at:
            if self.how == "raise":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)  # deferred: the swap finishes, then is undone
        self.copy(param, value)


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("how", ["raise", "signal"])
def test_reparametrize_interrupted_mid_copy_leaves_the_model_bit_exact(monkeypatch, how: str) -> None:
    handler = signal.getsignal(signal.SIGINT)
    model = _bert()
    state = _state(model)
    interrupt = _Interrupt(3, how)
    monkeypatch.setattr(reparam_module, "_copy", interrupt)
    with pytest.raises(KeyboardInterrupt):
        gs.reparametrize(model, condition=100.0)
    assert interrupt.calls >= 3
    _assert_bit_exact(model, state)
    assert signal.getsignal(signal.SIGINT) is handler  # the handler is put back


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("how", ["raise", "signal"])
def test_hide_interrupted_mid_copy_leaves_the_model_bit_exact(monkeypatch, how: str) -> None:
    model, batches = _bert(), _batches()
    state = _state(model)
    monkeypatch.setattr(reparam_module, "_copy", _Interrupt(2, how))
    with pytest.raises(KeyboardInterrupt):
        hide(model, batches, target="sharp", search_steps=10, evaluate=False)
    _assert_bit_exact(model, state)


def test_reparametrize_completes_when_not_interrupted() -> None:
    """The all-or-nothing swap still transforms the model: same function, moved weights."""
    model, batches = _bert(), _batches()
    logits, state = _logits(model, batches), _state(model)
    gs.reparametrize(model, condition=100.0)
    assert (_logits(model, batches) - logits).abs().max() <= 1e-10 * logits.abs().max()
    q = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.allclose(model.state_dict()[q], state[q])


# -------------------------------------------------------------------------------------------- the demo's section


@pytest.fixture(scope="module")
def mini_zoo(tmp_path_factory):
    from hf_geosharp.zoo import build_zoo, torch_threads

    with torch_threads(1):
        return build_zoo("mini", tmp_path_factory.getbasetemp() / "zoo", progress=False)


def test_demo_hide_and_seek_section(mini_zoo, tmp_path: Path, capsys) -> None:
    from hf_geosharp import cli

    args = ["demo", "--size", "mini", "--cache-dir", str(mini_zoo.root), "--out", str(tmp_path), "--n-examples", "64",
            "--batch-size", "32", "--steps", "3", "--hide-steps", "3", "--rho-sweep", "none"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    section = out[out.index("hide & seek:"):]
    for part in ("(i) a random symmetry element", "(ii) adversarial", "(iii) Kendall tau against the gap"):
        assert part in section
    ranks = dict(line.split() for line in section.split("(ii)")[0].splitlines()[3:] if line.strip())
    assert ranks["geodesic_sharpness_inv"] == "+1.00" and ranks["geodesic_sharpness_mix"] == "+1.00"
    assert (tmp_path / "hide_and_seek.png").stat().st_size > 0
    stored = (tmp_path / "hide_and_seek.jsonl").read_bytes()
    assert cli.main(args) == 0  # second run: every hide & seek number comes from the store
    assert (tmp_path / "hide_and_seek.jsonl").read_bytes() == stored
    assert capsys.readouterr().out.split("hide & seek:")[1].split("\nzoo:")[0] == section.split("hide & seek:")[1] \
        .split("\nzoo:")[0]


def test_hide_and_seek_moves_adaptive_and_not_geodesic(mini_zoo) -> None:
    from hf_geosharp.data import DataSpec, load_batches, load_model, load_processor
    from hf_geosharp.hiding import hide_and_seek
    from hf_geosharp.measures import Settings

    spec = DataSpec(dataset=str(mini_zoo.data_dir), n_examples=64, batch_size=32)
    dirs = {d.name: d for d in mini_zoo.model_dirs}

    def load(name):
        model = load_model(str(dirs[name]))
        return model, load_batches(model, load_processor(str(dirs[name]), model), spec)

    names = sorted(dirs)
    gaps = [m["test_error"] - m["train_error"] for m in (mini_zoo.metrics()[n] for n in names)]
    report = hide_and_seek(names, load, gaps, settings=Settings(steps=3, epsilon=0.0), condition=1000.0)
    for what in ("random", "adversarial"):
        for key in ("geodesic_sharpness_inv", "geodesic_sharpness_mix"):
            for a, b in zip(report.original[key], getattr(report, what)[key]):
                assert b == pytest.approx(a, rel=1e-4)  # measured in float64
    moved = [b / a for a, b in zip(report.original["adaptive_sharpness"], report.random["adaptive_sharpness"])]
    assert max(abs(m - 1) for m in moved) > 0.05
    sharp = next(c for c in report.showcase if c["target"] == "sharp")
    assert sharp["after"]["adaptive_sharpness"] > 2 * sharp["before"]["adaptive_sharpness"]
    assert report.max_output_deviation < 1e-3
