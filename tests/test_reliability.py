"""Reliability: bad inputs and faults through the three entry points (Python API, ``geosharp run``, ``evaluate``).

Every case is answered by a clear error or by a documented behaviour, and never by a damaged model: after each case
the model's parameters and buffers are bit-identical, and ``requires_grad``, ``.grad``, train/eval modes, dtypes and
devices are as before. The API cases are one table (:data:`API_CASES`); the CLI and evaluate cases reuse the bad inputs
that can reach them. Also here: determinism (same seed, same bits). The fast paths of the engine against their slow
references are in test_geometry.py, test_perturbation_space.py and test_solver.py.

Documented behaviours checked here (see also the docstrings of ``gs.geodesic_sharpness``):

* batches of unequal size are averaged per batch, not per example;
* any iterable of batches works (it is read once, into a list);
* the solver runs in eval mode: dropout left on, or gradient checkpointing switched on, changes nothing;
* activation checkpointing that stays on in eval mode gives the same number as none (the backward runs at the
  perturbed weights); the reentrant kind, which hides weights from ``inputs=``-restricted gradients, is refused;
* ``params="all"`` perturbs frozen parameters too (as AS23 does); ``params="trainable"`` never moves them;
* labels of ``-100`` are ignored (the loss's ``ignore_index``), other out-of-range labels are refused;
* a rank-deficient head (Assumption 5.1 violated) gives a finite result for ``epsilon > 0`` and the symmetry report
  warns about it; with ``epsilon=0`` the call refuses with a hint to raise ``epsilon``;
* half-precision models are measured (the perturbation is built in float32) with a warning that rounding to the
  model's dtype quantises the result;
* attention the mapper does not know is perturbed elementwise: with no mapped pair, geodesic sharpness *is* the clean
  adaptive sharpness, bit for bit;
* an exception or ``KeyboardInterrupt`` inside the loss propagates unchanged (with a note naming the batch), after the
  model has been restored.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hf_geosharp as gs
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import FAST, assert_intact, snapshot, tiny_batches, tiny_bert, token_ids

ARANGE_4 = torch.tensor([0, 101, 102, 100])  # added to -100: labels [-100, 1, 2, 0]
DENSE = "bert.encoder.layer.1.output.dense.weight"


# ---------------------------------------------------------------------------------------------------- fixtures
def tiny_funnel() -> nn.Module:
    """A classifier whose attention (FunnelRelMultiheadAttention) the symmetry mapper does not know."""
    from transformers import FunnelConfig, FunnelForSequenceClassification

    torch.manual_seed(0)
    config = FunnelConfig(vocab_size=100, block_sizes=[1], d_model=32, n_head=4, d_head=8, d_inner=64, num_labels=3)
    return FunnelForSequenceClassification(config).double().eval()


# ---------------------------------------------------------------------------------------------------- the API table
@dataclass
class Case:
    """One input through the Python API.

    ``prepare`` returns ``(model, batches, kwargs)`` and may damage copies of the defaults; ``call`` makes the call
    (default: worst-case geodesic inv). With ``raises`` the call must raise that type with ``match`` in the message
    (notes included); otherwise ``check(result, model, batches)`` states the documented behaviour."""

    id: str
    prepare: Callable[[], tuple[Any, Any, dict[str, Any]]]
    raises: type[BaseException] | None = None
    match: str = ""
    check: Callable[[Any, Any, Any], None] | None = None
    call: Callable[..., Any] = field(default=lambda model, batches, **kw: gs.geodesic_sharpness(model, batches, **kw))


def default(**kwargs: Any) -> Callable[[], tuple[Any, Any, dict[str, Any]]]:
    return lambda: (tiny_bert(), tiny_batches(), {**FAST, **kwargs})


def with_batches(edit: Callable[[list[dict[str, torch.Tensor]]], Any], **kwargs: Any) -> Callable[[], tuple]:
    def prepare():
        batches = tiny_batches()
        return tiny_bert(), edit(batches), {**FAST, **kwargs}

    return prepare


def with_model(edit: Callable[[nn.Module], Any], **kwargs: Any) -> Callable[[], tuple]:
    def prepare():
        model = tiny_bert(**kwargs.pop("model_kwargs", {}))
        edit(model)
        return model, tiny_batches(), {**FAST, **kwargs}

    return prepare


def set_batch_item(key: str, value: Callable[[dict], Any]) -> Callable[[list], list]:
    def edit(batches):
        batches[0][key] = value(batches[0])
        return batches

    return edit


def set_param(name: str, fn: Callable[[torch.Tensor], None]) -> Callable[[nn.Module], None]:
    def edit(model):
        with torch.no_grad():
            fn(dict(model.named_parameters())[name])

    return edit


def add_integer_parameter(model: nn.Module) -> None:
    model.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))


def rank_deficient(model: nn.Module) -> None:
    """Zero one column of head 0's G = [W_q^T; b_q] in layer 0: G^T G is singular (Assumption 5.1 violated)."""
    attn = model.bert.encoder.layer[0].attention.self
    with torch.no_grad():
        attn.query.weight[0].zero_()
        attn.query.bias[0] = 0.0


def nan_embeddings() -> dict[str, torch.Tensor]:
    return {"inputs_embeds": torch.full((4, 8, 32), float("nan"), dtype=torch.float64),
            "labels": torch.zeros(4, dtype=torch.long)}


def failing_loss(error: type[BaseException], at_call: int) -> Callable[[nn.Module, Any], torch.Tensor]:
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise error("injected failure")
        return model(**batch).loss

    return loss_fn


def infinite_when_moved(model: nn.Module) -> Callable[[nn.Module, Any], torch.Tensor]:
    """Finite at the trained weights, inf as soon as a weight moves: the solver must stop with a clear error."""
    reference = model.classifier.weight.detach().clone()

    def loss_fn(m, batch):
        loss = m(**batch).loss
        moved = not torch.equal(m.classifier.weight.detach(), reference)
        return loss * float("inf") if moved else loss

    return loss_fn


def frozen_stay_put(model: nn.Module) -> Callable[[nn.Module, Any], torch.Tensor]:
    """A loss that asserts, at every evaluation, that the frozen embedding is exactly the trained one."""
    reference = model.bert.embeddings.word_embeddings.weight.detach().clone()

    def loss_fn(m, batch):
        assert torch.equal(m.bert.embeddings.word_embeddings.weight.detach(), reference)
        return m(**batch).loss

    return loss_fn


class CheckpointedMLP(nn.Module):
    """A weight shared by two activation-checkpointed blocks, in every mode (transformers models checkpoint only in
    training, and the solver runs in eval mode, so this is the case that reaches the solver)."""

    def __init__(self, checkpointing: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.shared, self.head = (nn.Linear(6, 6).double(), nn.Linear(6, 6).double(),
                                              nn.Linear(6, 3).double())
        self.checkpointing = checkpointing

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(h))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(2):
            if self.checkpointing == "off":
                h = self.block(h)
            else:
                h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.checkpointing == "reentrant")
        return nn.functional.cross_entropy(self.head(h), labels)


def checkpointed(checkpointing: str) -> tuple[nn.Module, list, dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))]
    return CheckpointedMLP(checkpointing), batches, {**FAST, "loss_fn": lambda m, b: m(*b)}


def _same_as_without_checkpointing(result, model, batches) -> None:
    ref = gs.adaptive_sharpness(CheckpointedMLP("off"), batches, variant="clean", **FAST, loss_fn=lambda m, b: m(*b))
    assert result.per_batch == pytest.approx(ref.per_batch, rel=1e-12)
    assert result.value > 0


def loss_case(make_loss: Callable[[nn.Module], Callable], **kwargs: Any) -> tuple[nn.Module, list, dict[str, Any]]:
    model = tiny_bert()
    return model, tiny_batches(), {**FAST, **kwargs, "loss_fn": make_loss(model)}


def frozen_trainable() -> tuple[nn.Module, list, dict[str, Any]]:
    model = tiny_bert()
    freeze("bert.embeddings")(model)
    return model, tiny_batches(), {**FAST, "params": "trainable", "loss_fn": frozen_stay_put(model)}


def freeze(prefix: str) -> Callable[[nn.Module], None]:
    def edit(model):
        for name, p in model.named_parameters():
            if name.startswith(prefix):
                p.requires_grad_(False)

    return edit


def _finite(result, model, batches) -> None:
    assert math.isfinite(result.value) and all(math.isfinite(v) for v in result.per_batch)


def _same_as_reference(**reference_kwargs: Any) -> Callable[[Any, Any, Any], None]:
    """The result equals a clean run (fresh default model, eval mode, default batches) bit for bit."""

    def check(result, model, batches):
        ref = gs.geodesic_sharpness(tiny_bert(), tiny_batches(), **{**FAST, **reference_kwargs})
        assert result.per_batch == ref.per_batch

    return check


def _per_batch_mean(result, model, batches) -> None:
    assert len(result.per_batch) == 2
    assert result.value == pytest.approx(sum(result.per_batch) / 2, rel=1e-15)


def _rank_deficient_is_finite_and_reported(result, model, batches) -> None:
    _finite(result, model, batches)
    warnings = map_symmetries(model).summary(model)["conditioning"]["warnings"]
    assert any("layer.0" in w and "singular" in w for w in warnings), warnings


def _unmapped_equals_clean_adaptive(result, model, batches) -> None:
    assert map_symmetries(model).fallbacks and not map_symmetries(model).blocks
    clean = gs.adaptive_sharpness(model, batches, variant="clean", **FAST)
    assert result.per_batch == clean.per_batch


def _half_precision(result, model, batches) -> None:
    _finite(result, model, batches)
    assert all(p.dtype == next(model.parameters()).dtype for p in model.parameters())


def _frozen_flags_kept(result, model, batches) -> None:
    _finite(result, model, batches)
    assert not model.bert.embeddings.word_embeddings.weight.requires_grad


API_CASES = [
    # wrong types
    Case("model-not-a-module", lambda: ("bert", tiny_batches(), FAST), TypeError, "torch.nn.Module"),
    Case("batches-not-iterable", lambda: (tiny_bert(), 5, FAST), TypeError, "iterable of batches"),
    Case("batches-a-single-dict", lambda: (tiny_bert(), tiny_batches()[0], FAST), TypeError, "iterable of batches"),
    Case("batch-a-tensor", lambda: (tiny_bert(), [torch.zeros(4, 8, dtype=torch.long)], FAST), TypeError,
         "dict of model inputs"),
    Case("batch-a-string", lambda: (tiny_bert(), ["a review"], FAST), TypeError, "dict of model inputs"),
    Case("float-token-ids", with_batches(set_batch_item("input_ids", lambda b: b["input_ids"].double())), RuntimeError,
         "raised while measuring batch 0"),
    Case("rho-a-string", default(rho="0.1"), ValueError, "rho must be a positive"),
    Case("rho-a-bool", default(rho=True), ValueError, "rho must be a positive"),
    Case("rho-infinite", default(rho=float("inf")), ValueError, "rho must be a positive"),
    Case("steps-a-float", default(steps=2.5), ValueError, "steps must be a positive integer"),
    Case("steps-a-bool", default(steps=True), ValueError, "steps must be a positive integer"),
    Case("n-samples-zero", default(mode="average", n_samples=0), ValueError, "n_samples must be"),
    Case("seed-a-string", default(seed="0"), ValueError, "seed must be an integer"),
    Case("epsilon-negative", default(epsilon=-1e-6), ValueError, "epsilon must be"),
    Case("epsilon-nan", default(epsilon=float("nan")), ValueError, "epsilon must be"),
    Case("metric-unknown", default(metric="euclid"), ValueError, "metric must be"),
    Case("ball-unknown", default(ball="adaptive"), ValueError, "ball must be 'calibrated' or 'paper'"),
    Case("params-unknown", default(params="some"), ValueError, "params must be"),
    Case("curvature-unknown", default(elementwise_curvature="cubic"), ValueError, "elementwise_curvature must be"),
    Case("loss-not-scalar", default(loss_fn=lambda m, b: m(**b).logits.sum(-1)), TypeError, "scalar tensor"),
    Case("loss-a-float", default(loss_fn=lambda m, b: float(m(**b).loss)), TypeError, "scalar tensor"),
    Case("loss-detached", default(loss_fn=lambda m, b: m(**b).loss.detach()), TypeError, "does not depend"),
    Case("symmetry-map-of-another-model", default(symmetry_map=map_symmetries(nn.Linear(2, 2))), ValueError,
         "another model"),
    # empty and ragged
    Case("no-batches", lambda: (tiny_bert(), [], FAST), ValueError, "No batches"),
    Case("empty-dict", lambda: (tiny_bert(), [{}], FAST), ValueError, "Batch 0 is empty"),
    Case("zero-rows", with_batches(lambda bs: [{k: v[:0] for k, v in bs[0].items()}]), ValueError, "Batch 0 is empty"),
    Case("ragged-rows", with_batches(set_batch_item("labels", lambda b: b["labels"][:3])), ValueError, "ragged"),
    Case("ragged-sequence", with_batches(set_batch_item("attention_mask", lambda b: b["attention_mask"][:, :6])),
         ValueError, "sequence length"),
    Case("generator-of-batches", lambda: (tiny_bert(), (b for b in tiny_batches()), FAST), check=_same_as_reference()),
    Case("unequal-batch-sizes", with_batches(lambda bs: [bs[0], {k: v[:2] for k, v in bs[1].items()}]),
         check=_per_batch_mean),
    # labels
    Case("label-too-large", with_batches(set_batch_item("labels", lambda b: b["labels"].fill_(7))), ValueError,
         "has label 7, but the model has 3 classes"),
    Case("label-negative", with_batches(set_batch_item("labels", lambda b: b["labels"].fill_(-2))), ValueError,
         "has label -2"),
    Case("label-ignore-index", with_batches(set_batch_item("labels", lambda b: b["labels"].fill_(-100).add_(ARANGE_4))),
         check=_finite),
    Case("labels-missing", with_batches(lambda bs: [{k: v for k, v in b.items() if k != "labels"} for b in bs]),
         ValueError, "returned no loss"),
    # non-finite numbers
    Case("nan-weight", with_model(set_param("classifier.bias", lambda p: p.__setitem__(0, float("nan")))), ValueError,
         "classifier.bias"),
    Case("inf-weight", with_model(set_param(DENSE, lambda p: p.__setitem__((0, 0), float("inf")))), ValueError, DENSE),
    Case("nan-input", lambda: (tiny_bert(), [nan_embeddings()], FAST), FloatingPointError, "unperturbed weights"),
    Case("inf-at-a-perturbed-point", lambda: loss_case(infinite_when_moved), FloatingPointError, "lower rho"),
    # Assumption 5.1
    Case("rank-deficient-head", with_model(rank_deficient), check=_rank_deficient_is_finite_and_reported),
    Case("rank-deficient-head-no-epsilon", with_model(rank_deficient, epsilon=0.0), ValueError, "epsilon"),
    # precision and devices
    Case("bfloat16-model", lambda: (tiny_bert(torch.bfloat16), tiny_batches(), FAST), check=_half_precision),
    Case("float16-model", lambda: (tiny_bert(torch.float16), tiny_batches(), FAST), check=_half_precision),
    Case("meta-device", lambda: (tiny_bert().to("meta"), tiny_batches(), FAST), ValueError, "meta device"),
    Case("integer-parameter", with_model(add_integer_parameter), ValueError, "floating-point"),
    # modes and flags
    Case("dropout-left-on", lambda: (tiny_bert(dropout=0.3).train(), tiny_batches(), FAST), check=_same_as_reference()),
    Case("gradient-checkpointing-on", with_model(lambda m: m.gradient_checkpointing_enable()),
         check=_same_as_reference()),
    Case("gradient-checkpointing-in-train-mode", with_model(lambda m: (m.gradient_checkpointing_enable(), m.train())),
         check=_same_as_reference()),
    Case("activation-checkpointing-in-eval-mode", lambda: checkpointed("non-reentrant"),
         check=_same_as_without_checkpointing,
         call=lambda model, batches, **kw: gs.adaptive_sharpness(model, batches, variant="clean", **kw)),
    Case("reentrant-checkpointing-in-eval-mode", lambda: checkpointed("reentrant"), ValueError, "use_reentrant=False",
         call=lambda model, batches, **kw: gs.adaptive_sharpness(model, batches, variant="clean", **kw)),
    Case("stale-grads-present", with_model(lambda m: [setattr(p, "grad", torch.ones_like(p)) for p in m.parameters()]),
         check=_same_as_reference()),
    Case("frozen-embeddings-all", with_model(freeze("bert.embeddings")), check=_frozen_flags_kept),
    Case("frozen-embeddings-trainable", lambda: frozen_trainable(), check=_frozen_flags_kept),
    Case("all-frozen-trainable", with_model(freeze(""), params="trainable"), ValueError,
         "no parameter has requires_grad"),
    # unmappable attention
    Case("unmapped-attention", lambda: (tiny_funnel(), tiny_batches(), FAST), check=_unmapped_equals_clean_adaptive),
    Case("unmapped-attention-strict", lambda: (tiny_funnel(), tiny_batches(), FAST), ValueError, "strict=False",
         call=lambda model, batches, **kw: gs.geodesic_sharpness(
             model, batches, symmetry_map=map_symmetries(model, strict=True), **kw)),
    # faults mid-solve
    Case("error-in-loss-mid-solve", default(loss_fn=failing_loss(RuntimeError, 3)), RuntimeError, "injected failure"),
    Case("keyboard-interrupt-mid-solve", default(loss_fn=failing_loss(KeyboardInterrupt, 3)), KeyboardInterrupt, ""),
    Case("interrupt-in-average-case", default(mode="average", loss_fn=failing_loss(KeyboardInterrupt, 2)),
         KeyboardInterrupt, ""),
    Case("error-in-adaptive-as23", default(loss_fn=failing_loss(RuntimeError, 4)), RuntimeError, "injected failure",
         call=lambda model, batches, **kw: gs.adaptive_sharpness(model, batches, **kw)),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c.id for c in API_CASES])
@pytest.mark.filterwarnings("ignore:The model computes in")
def test_bad_input_through_the_api(case: Case) -> None:
    model, batches, kwargs = case.prepare()
    snap = snapshot(model) if isinstance(model, nn.Module) else None
    if case.raises is not None:
        with pytest.raises(case.raises) as info:
            case.call(model, batches, **kwargs)
        text = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
        assert case.match in text, text
    else:
        case.check(case.call(model, batches, **kwargs), model, batches)
    if snap is not None:
        assert_intact(model, snap)


def test_half_precision_warns_that_rounding_quantises_the_result():
    with pytest.warns(UserWarning, match="bfloat16.*model.float"):
        gs.adaptive_sharpness(tiny_bert(torch.bfloat16), tiny_batches(), **FAST)


def test_notes_name_the_batch_but_keep_the_type():
    batches = tiny_batches(3)
    batches[2]["input_ids"] = batches[2]["input_ids"].double()
    with pytest.raises(RuntimeError) as info:
        gs.adaptive_sharpness(tiny_bert(), batches, **FAST)
    notes = getattr(info.value, "__notes__", [])
    assert any("batch 2" in note for note in notes) or not hasattr(info.value, "add_note")


# ---------------------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize(
    "measure",
    [
        dict(fn="geodesic", metric="inv"), dict(fn="geodesic", metric="mix"), dict(fn="adaptive", variant="clean"),
        dict(fn="adaptive", variant="as23"), dict(fn="geodesic", metric="inv", mode="average", n_samples=3),
        dict(fn="adaptive", mode="average", n_samples=3),
    ],
    ids=["inv", "mix", "adaptive-clean", "adaptive-as23", "inv-average", "adaptive-average"],
)
def test_same_seed_same_bits_on_fresh_models(measure):
    """Two fresh models from the same seed, the global RNG disturbed in between: identical per-batch values."""
    kwargs = dict(measure)
    fn = gs.geodesic_sharpness if kwargs.pop("fn") == "geodesic" else gs.adaptive_sharpness
    first = fn(tiny_bert(torch.float32), tiny_batches(), seed=7, **FAST, **kwargs)
    torch.manual_seed(12345)
    torch.rand(100)
    second = fn(tiny_bert(torch.float32), tiny_batches(), seed=7, **FAST, **kwargs)
    assert first.per_batch == second.per_batch and first.clean_loss == second.clean_loss
    if kwargs.get("mode") == "average":
        other = fn(tiny_bert(torch.float32), tiny_batches(), seed=8, **FAST, **kwargs)
        assert other.per_batch != first.per_batch


@pytest.mark.parametrize("metric", ["mix"])
def test_same_bits_for_the_same_seed_and_thread_count(metric):
    """What docs/method.md promises bit for bit: the same seed, inputs, torch build and kernels, and the same torch
    thread count (part of what determines a float sum: torch splits large reductions by thread). Each thread count
    repeats its own bits, also after a run at the other count; across counts only closeness is promised."""
    threads = torch.get_num_threads()
    runs: dict[int, list[list[float]]] = {1: [], 2: []}
    try:
        for n in (1, 2, 1, 2):
            torch.set_num_threads(n)
            runs[n].append(gs.geodesic_sharpness(tiny_bert(torch.float32), tiny_batches(), metric=metric, seed=3,
                                                 **FAST).per_batch)
    finally:
        torch.set_num_threads(threads)
    assert runs[1][0] == runs[1][1] and runs[2][0] == runs[2][1]
    assert runs[1][0] == pytest.approx(runs[2][0], rel=1e-3)


# ---------------------------------------------------------------------------------------------------- fast paths
# ---------------------------------------------------------------------------------------------------- CLI
def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    from .fixtures.hf_models import save_text_model, tiny_tokenizer, write_csv
    from .fixtures.hf_models import tiny_bert as fixture_bert

    root = tmp_path_factory.mktemp("reliability-cli")
    nan_model = fixture_bert()
    with torch.no_grad():
        nan_model.classifier.bias[0] = float("nan")
    nan_model.save_pretrained(root / "nan-model")
    tiny_tokenizer(root / "nan-model").save_pretrained(root / "nan-model")
    bad_labels = root / "bad-labels.csv"
    rows = [f"good film {i},{5 if i == 3 else i % 2}" for i in range(8)]  # one label 5 for a 2-class model
    bad_labels.write_text("review,label\n" + "\n".join(rows) + "\n")
    return {
        "model": save_text_model(root / "model"), "csv": write_csv(root / "reviews.csv", 12),
        "bad_labels": bad_labels, "nan_model": root / "nan-model", "root": root,
    }  # fmt: skip


CLI_CASES = [
    ("missing-model", {"--model": "does-not-exist"}, 2, "does-not-exist"),
    ("missing-dataset", {"--dataset": "no-such-file.csv"}, 2, "no-such-file.csv"),
    ("label-out-of-range", {"--dataset": "bad_labels"}, 2, "class ids [5]"),
    ("nan-weights", {"--model": "nan_model"}, 2, "NaN"),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_input_through_the_cli(case, cli_files, capsys):
    from hf_geosharp import cli

    _, override, code, message = case
    args = {"--model": "model", "--dataset": "csv", **override}
    resolved = {k: str(cli_files.get(v, v)) for k, v in args.items()}
    model_folder = Path(resolved["--model"])
    before = _digest(model_folder) if model_folder.is_dir() else None
    argv = ["run", *[x for kv in resolved.items() for x in kv], "--n-examples", "8", "--batch-size", "4",
            "--steps", "2", "--rho", "0.05", "--quiet"]  # fmt: skip
    assert cli.main(argv) == code
    assert message in capsys.readouterr().err
    assert before is None or _digest(model_folder) == before


@pytest.mark.parametrize("argv, message", [(["--rho", "0"], "rho"), (["--batch-size", "0"], "batch-size"),
                                            (["--steps", "-1"], "steps")])
def test_cli_refuses_bad_numbers_as_usage_errors(argv, message, cli_files, capsys):
    from hf_geosharp import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--model", str(cli_files["model"]), "--dataset", str(cli_files["csv"]), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- evaluate module
EVALUATE_CASES = [
    ("label-out-of-range", lambda m: dict(model=m, input_ids=token_ids(), labels=[0, 1, 2, 9, 0, 1]), ValueError,
     "has label 9"),
    ("labels-missing", lambda m: dict(model=m, input_ids=token_ids()), ValueError, "labels= is missing"),
    ("model-and-model-id", lambda m: dict(model=m, model_id="x", input_ids=token_ids(), labels=[0] * 6), ValueError,
     "exactly one"),
    ("metric-unknown", lambda m: dict(model=m, input_ids=token_ids(), labels=[0] * 6, metric="euclid"), ValueError,
     "metric="),
    ("rho-negative", lambda m: dict(model=m, input_ids=token_ids(), labels=[0] * 6, rho=-1.0), ValueError,
     "rho must be"),
    ("nan-weights", lambda m: (set_param("classifier.bias", lambda p: p.__setitem__(0, float("nan")))(m),
                               dict(model=m, input_ids=token_ids(), labels=[0] * 6))[1], ValueError, "classifier.bias"),
]


@pytest.mark.parametrize("case", EVALUATE_CASES, ids=[c[0] for c in EVALUATE_CASES])
def test_bad_input_through_the_evaluate_module(case, measurement):
    _, inputs, error, message = case
    model = tiny_bert()
    kwargs = inputs(model)
    snap = snapshot(model)
    with pytest.raises(error, match=message):
        measurement.compute(**kwargs, steps=2, batch_size=3, progress=False)
    assert_intact(model, snap)


def test_evaluate_module_pads_ragged_token_lists_and_leaves_the_model_alone(measurement):
    model = tiny_bert()
    model.train()
    snap = snapshot(model)
    rows = [r[: 3 + i] for i, r in enumerate(token_ids())]  # lengths 3..8: padded per batch (documented)
    out = measurement.compute(model=model, input_ids=rows, labels=[0, 1, 2, 0, 1, 2], steps=2, batch_size=3, rho=0.05)
    assert math.isfinite(out["geodesic_sharpness_inv"]) and len(out["geodesic_sharpness_inv_per_batch"]) == 2
    assert_intact(model, snap)


def test_model_copies_are_not_needed_by_any_entry_point():
    """The engine never mutates the model, so a deep copy of it is never taken: a model that refuses to be copied
    (e.g. one holding a file handle or a lock) works."""

    class Uncopyable(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = tiny_bert()

        def forward(self, **batch):
            return self.inner(**batch)

        def __deepcopy__(self, memo):
            raise RuntimeError("this model cannot be copied")

    model = Uncopyable()
    snap = snapshot(model)
    result = gs.geodesic_sharpness(model, tiny_batches(), **FAST)
    assert math.isfinite(result.value)
    assert_intact(model, snap)
    with pytest.raises(RuntimeError):
        copy.deepcopy(model)
