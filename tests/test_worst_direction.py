"""Where the worst case is (docs/where.md): the breakdown by layer and head against slow references (the dense
:class:`ReferenceSpace` for the per-head metric, central finite differences for the first-order term), the returned
perturbation (it reproduces the solver's best loss and leaves the model's bits alone), the loss profile (its value at
``t = 1`` is the batch's worst case), the figures, and ``geosharp run --by-layer --profile`` on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import hf_geosharp as gs
from hf_geosharp import cli
from hf_geosharp.engine.builder import build
from hf_geosharp.engine.model_function.objective import default_loss, preserved_model_state
from hf_geosharp.engine.placement.single import SingleProcess
from hf_geosharp.engine.settings import RunSettings
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions
from hf_geosharp.engine.space.reference_space import ReferenceSpace
from hf_geosharp.engine.worst_direction import WorstDirection, block_of, profile_points
from hf_geosharp.symmetry import map_symmetries

from .fixtures.hf_models import one_thread, save_text_model, tiny_bert, write_csv  # noqa: F401
from .fixtures.intact import assert_intact, snapshot

RHO = 0.1


def _batches(n: int = 2, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(5, 90, (4, 12), generator=g), "labels": torch.tensor([0, 1, 0, 1])}
            for _ in range(n)]


@pytest.fixture(scope="module")
def model():
    return tiny_bert().double().eval()


@pytest.fixture(scope="module")
def geodesic(model):
    return gs.geodesic_sharpness(model, _batches(), rho=RHO, steps=5, progress=False, return_perturbation=True,
                                 profile_points=5)


@pytest.fixture(scope="module")
def adaptive(model):
    return gs.adaptive_sharpness(model, _batches(), rho=RHO, steps=5, progress=False, return_perturbation=True,
                                 profile_points=5)


def test_block_names_follow_the_layers():
    assert block_of("bert.encoder.layer.3.attention.self.query.weight") == ("bert.encoder.layer.3", True)
    assert block_of("model.layers.0.self_attn.q_proj.weight") == ("model.layers.0", True)
    assert block_of("decoder.block.5.layer.1.DenseReluDense.wi.weight") == ("decoder.block.5", True)
    assert block_of("bert.embeddings.word_embeddings.weight") == ("bert.embeddings", False)
    assert block_of("classifier.weight") == ("classifier", False)
    assert profile_points(5) == [0.0, 0.5, 1.0, 1.5, 2.0]
    with pytest.raises(ValueError, match="odd integer"):
        profile_points(4)


@pytest.mark.parametrize("which", ["geodesic", "adaptive"])
def test_shares_sum_to_one_and_layers_hold_their_heads(which, request):
    res = request.getfixturevalue(which)
    b = res.breakdown
    names = [x.name for x in b.layers]
    assert names == ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "bert.pooler", "classifier"]
    assert [x.layer for x in b.layers] == [None, 0, 1, None, None]
    for what in ("norm_share", "first_order_share"):
        assert sum(getattr(x, what) for x in b.layers) == pytest.approx(1.0, abs=1e-12)
        assert sum(getattr(x, what) for x in [*b.heads, b.outside_pairs]) == pytest.approx(1.0, abs=1e-12)
    assert b.norm_sq == pytest.approx(RHO**2, rel=1e-9)  # Auto-PGD's best points lie on the sphere here
    assert all(x.norm_sq >= 0 for x in b.layers)
    if which == "adaptive":
        assert b.heads == [] and b.outside_pairs.norm_share == pytest.approx(1.0)
        return
    assert len(b.heads) == 16  # 2 layers x 4 heads x (QK, VO)
    assert {(h.layer, h.head, h.kind) for h in b.heads} == {(i, j, k) for i in (0, 1) for j in range(4)
                                                            for k in ("qk", "vo")}
    for layer in (0, 1):  # a layer's heads are part of it: they cannot exceed it
        heads = sum(h.norm_sq for h in b.heads if h.layer == layer)
        assert 0 < heads < next(x.norm_sq for x in b.layers if x.layer == layer)
    assert res.to_dict()["breakdown"]["heads"][0]["kind"] in ("qk", "vo") and "perturbations" not in res.to_dict()


def test_the_per_head_metric_matches_the_dense_reference():
    """Each head's part of ||xi||_g^2 is the dense reference's squared norm of xi restricted to that head, and the
    parts of the segments and pairs add up to the fast space's inner product."""
    m = tiny_bert().double()
    theta = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    blocks = map_symmetries(m).blocks
    for metric in ("inv", "mix"):
        options = SpaceOptions(metric, 1e-3)
        fast, ref = PerturbationSpace(theta, blocks, options), ReferenceSpace(theta, blocks, options)
        xi = fast.horizontal(torch.randn(theta.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
                             * theta.abs())
        egrad = torch.randn(theta.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        seg_norm, _ = fast.segment_products(xi, xi)
        _, seg_first = fast.segment_products(egrad, xi)
        pairs = fast.pair_products(xi, xi)
        total = float(seg_norm.sum() + sum(p[0].sum() for p in pairs))
        assert total == pytest.approx(float(fast.inner_product(xi, xi)), rel=1e-10)
        first = float(seg_first.sum() + sum(p[1].sum() for p in fast.pair_products(egrad, xi)))
        assert first == pytest.approx(float(torch.dot(egrad, xi)), rel=1e-10)
        anchors = torch.cat(fast.pair_anchors())
        heads = torch.cat([p[0] for p in pairs])
        checked = 0
        for block in blocks:
            for k in range(block.n_pairs):
                j = int((anchors == block.G_index[k, 0, 0]).nonzero())
                mask = torch.zeros_like(xi)
                mask[block.G_index[k].reshape(-1)] = mask[block.H_index[k].reshape(-1)] = 1.0
                assert float(heads[j]) == pytest.approx(float(ref.norm(xi * mask)) ** 2, rel=1e-8, abs=1e-14)
                checked += 1
        assert checked == 16


def test_the_first_order_term_per_block_matches_finite_differences(model):
    """``<grad L(w), xi_b>`` per layer and per head equals d/ds L(Exp(w; s xi_b)) at 0 (central differences, fp64):
    the derivative of Exp at 0 is the identity, so this holds for every block ``xi_b`` of ``xi``. The paper's ball:
    its random draws give the heads first-order terms far above the differences' rounding (1e-12)."""
    settings = RunSettings(RHO, steps=1, options=SpaceOptions("inv", ball="paper"), step_normalization="euclidean")
    batch = _batches(1)[0]
    smap = map_symmetries(model)
    placement = SingleProcess(model)
    with preserved_model_state(model):
        space, objective = build(model, settings, placement, default_loss, {0: batch}, smap)
        objective.batch = batch
        assert space.numel == smap.n_params  # the whole flat vector: the map's indices are the space's
        reader = WorstDirection(space, objective, placement.holding.names, placement.holding.rows, smap, "x")
        xi = space.project(space.random_tangent_vector(torch.Generator().manual_seed(3)), RHO)
        reading = reader.read(xi, 0, 0.0, 0.0)

        def derivative(v: torch.Tensor, s: float = 1e-4) -> float:
            return (objective(s * v, False)[0] - objective(-s * v, False)[0]) / (2 * s)

        layers = reader.layer_keys
        starts = reader.starts
        for i, (key, _) in enumerate(layers):
            v = torch.zeros_like(xi)
            for s, layer in enumerate(reader.segment_layer):
                if layer == i:
                    v[starts[s] : starts[s + 1]] = xi[starts[s] : starts[s + 1]]
            assert reading["layers"][i][1] == pytest.approx(derivative(v), rel=1e-6, abs=1e-12), key
        pairs = [reader.pairs[j] for j in reader.head_order]
        for (label, _, head, kind, _), (_, first) in zip(pairs, reading["heads"]):
            block = next(b for b in smap.blocks if b.kind == kind and b.labels[head] == label)
            v = torch.zeros_like(xi)
            for index in (block.G_index[head], block.H_index[head]):
                v[index.reshape(-1)] = xi[index.reshape(-1)]
            assert first == pytest.approx(derivative(v), rel=1e-6, abs=1e-12), label


@pytest.mark.parametrize("which", ["geodesic", "adaptive"])
def test_the_perturbation_reproduces_the_best_loss_and_leaves_the_model_alone(which, model, request):
    res = request.getfixturevalue(which)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = _batches()
    assert len(res.perturbations) == 2
    for p in res.perturbations:
        assert set(p.delta) <= {n for n, _ in model.named_parameters()}
        word = dict(model.named_parameters())["bert.embeddings.word_embeddings.weight"]
        assert p.delta["bert.embeddings.word_embeddings.weight"].shape == word.shape  # held by rows, returned whole
        with p.applied(model), torch.no_grad():
            loss = float(model(**batches[p.batch]).loss)
        assert loss == pytest.approx(p.loss, abs=1e-10)
        assert loss - p.clean_loss == pytest.approx(res.per_batch[p.batch], abs=1e-10)
        assert any(float(d.abs().max()) > 0 for d in p.delta.values())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-equal
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


@pytest.mark.parametrize("labels", [1, 3])
def test_a_perturbation_refuses_a_model_of_other_shapes_and_leaves_it_alone(geodesic, labels):
    """Measured on a 2-label BERT, applied to a 1-label one (the classifier would broadcast to 2 outputs) or a
    3-label one (a raw shape error): refused before the model is touched, naming the parameter and both shapes."""
    other = tiny_bert(num_labels=labels).double()
    snap = snapshot(other)
    p = geodesic.perturbations[0]
    with pytest.raises(ValueError, match="classifier.weight") as info:
        with p.applied(other):
            pytest.fail("the block ran on a model the perturbation does not fit")
    assert f"[{labels}, 32]" in str(info.value) and "[2, 32]" in str(info.value)
    assert_intact(other, snap)
    name = "classifier.weight"
    integer = dataclasses.replace(p, delta={**p.delta, name: p.delta[name].to(torch.int64)})
    with pytest.raises(ValueError, match="not a floating-point tensor"), integer.applied(other):
        pass
    assert_intact(other, snap)


@pytest.mark.parametrize("which", ["geodesic", "adaptive"])
def test_the_profile_at_rho_is_the_worst_case(which, request):
    res = request.getfixturevalue(which)
    prof = res.profile
    assert prof.t == [0.0, 0.5, 1.0, 1.5, 2.0]
    for b, value in enumerate(res.per_batch):
        assert prof.geodesic[b][2] == pytest.approx(value, abs=1e-12)
        assert prof.geodesic[b][0] == pytest.approx(0.0, abs=1e-12) and prof.segment[b][0] == pytest.approx(0.0,
                                                                                                            abs=1e-12)
        assert prof.segment[b][2] == pytest.approx(value, abs=1e-10)  # the same end point
    if which == "adaptive":  # first order: the geodesic is the segment
        for geo, seg in zip(prof.geodesic, prof.segment):
            assert geo == pytest.approx(seg, abs=1e-10)


def test_figures_draw(geodesic, adaptive, tmp_path):
    from hf_geosharp.plots import breakdown_heatmap, heatmap_matrix, profile_figure, save_figure

    names, heads, matrix = heatmap_matrix(geodesic.breakdown)
    assert names == ["bert.encoder.layer.0", "bert.encoder.layer.1"] and heads == [0, 1, 2, 3]
    qk_vo = {(h.layer, h.head): 0.0 for h in geodesic.breakdown.heads}
    for h in geodesic.breakdown.heads:
        qk_vo[(h.layer, h.head)] += h.norm_share
    assert matrix[1][2] == pytest.approx(qk_vo[(1, 2)])
    fig = profile_figure({"geodesic_sharpness_inv": geodesic, "adaptive_sharpness": adaptive}, "tiny")
    labels = [line.get_label() for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]
    assert "Geodesic sharpness (inv): geodesic" in labels
    assert any(label.startswith("Adaptive sharpness") for label in labels)
    save_figure(fig, tmp_path / "p.png")
    save_figure(breakdown_heatmap(geodesic.breakdown, "tiny"), tmp_path / "h.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "h.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no result has a profile"):
        profile_figure({"adaptive_sharpness": gs.adaptive_sharpness(tiny_bert(), _batches(1), steps=1,
                                                                     progress=False)}, "tiny")


def test_average_case_has_no_breakdown_and_refuses_the_opt_ins(model):
    res = gs.geodesic_sharpness(model, _batches(1), mode="average", n_samples=2, progress=False)
    assert res.breakdown is None and res.profile is None and res.perturbations is None
    with pytest.raises(ValueError, match="need a worst case"):
        gs.geodesic_sharpness(model, _batches(1), mode="average", n_samples=2, progress=False, profile_points=5)


def test_run_by_layer_and_profile_on_a_tiny_model(tmp_path, capsys):
    bert, csv = save_text_model(tmp_path / "bert"), write_csv(tmp_path / "r.csv", 10)
    out = tmp_path / "out.json"
    code = cli.main([str(a) for a in ("run", "--model", bert, "--dataset", csv, "--n-examples", 6, "--batch-size", 3,
                                      "--steps", 2, "--rho", 0.05, "--by-layer", "--profile", tmp_path / "figs",
                                      "--json", out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "norm share" in printed and "first-order share" in printed and "bert.encoder.layer.1" in printed
    assert "top heads" in printed and "16 attention pairs hold" in printed
    figure = tmp_path / "figs" / "bert_profile.png"
    assert figure.read_bytes()[:4] == b"\x89PNG" and f"wrote {figure}" in printed
    report = json.loads(out.read_text())
    inv = report["results"]["geodesic_sharpness_inv"]
    assert math.isclose(sum(b["norm_share"] for b in inv["breakdown"]["layers"]), 1.0, abs_tol=1e-9)
    assert inv["profile"]["geodesic"][0][10] == pytest.approx(inv["per_batch"][0], abs=1e-9)
    assert cli.main(["run", "--model", str(bert), "--dataset", str(csv), "--mode", "average", "--profile"]) == 2
    assert "--profile draws the worst case" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [dict(steps="auto", max_steps=80), dict(variant="as23", steps=4)],
                         ids=["auto-several-starts", "as23"])
def test_the_perturbation_is_the_best_point_of_every_solver(kwargs, model):
    """Under steps="auto" a later start reuses the first start's rows (the antipode is made in place), so the best
    point is kept aside; AS23's solver returns its own. Either way the perturbation gives the best loss."""
    fn = gs.adaptive_sharpness if "variant" in kwargs else gs.geodesic_sharpness
    batches = _batches(1, seed=4)
    res = fn(model, batches, rho=0.5, progress=False, return_perturbation=True, **kwargs)
    p = res.perturbations[0]
    with p.applied(model), torch.no_grad():
        loss = float(model(**batches[0]).loss)
    assert loss - p.clean_loss == pytest.approx(res.value, abs=1e-10)
    assert sum(x.norm_share for x in res.breakdown.layers) == pytest.approx(1.0, abs=1e-12)


def test_the_leaderboard_draws_where_each_geodesic_worst_case_sits(geodesic, adaptive, tmp_path):
    """From stored records (plain data, as a results store holds them): one heat map per model and geodesic measure;
    none for a measure without heads (adaptive) or a record from before breakdowns."""
    from hf_geosharp.leaderboard.report import heatmaps
    from hf_geosharp.leaderboard.run import Leaderboard

    stored = json.loads(json.dumps({"inv": geodesic.to_dict(), "adaptive": adaptive.to_dict()}))
    records = [{"breakdown": stored["inv"]["breakdown"]}, {"breakdown": stored["adaptive"]["breakdown"]}]
    board = Leaderboard([], ["geodesic_sharpness_inv", "adaptive_sharpness"], None,
                        {"org/tiny": records, "old": [{"value": 1.0}, None]})
    written = heatmaps(board, tmp_path)
    assert written == [tmp_path / "where" / "org_tiny__geodesic_sharpness_inv.png"]
    assert written[0].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("measure", ["geodesic", "adaptive"])
def test_the_clean_gradient_kept_by_the_solver_gives_the_same_breakdown_with_one_pass_less(measure, model,
                                                                                          monkeypatch):
    """Where the memory rule keeps it, the breakdown reads the gradient at the clean point that the solver's first
    evaluation computed: the same bits as its own forward and backward, which it then spares (one per batch)."""
    from hf_geosharp.engine.model_function import objective as objective_module
    from hf_geosharp.engine.solvers import memory

    calls = []
    on_device = objective_module.Objective.on_device

    def counted(self, xi, need_grad, *args, **kwargs):
        calls.append(need_grad)
        return on_device(self, xi, need_grad, *args, **kwargs)

    monkeypatch.setattr(objective_module.Objective, "on_device", counted)
    fn = gs.geodesic_sharpness if measure == "geodesic" else gs.adaptive_sharpness
    runs = {}
    for keep in (True, False):
        monkeypatch.setattr(memory, "keeps_clean_gradient", lambda footprint, keep=keep: keep)
        calls.clear()
        res = fn(model, _batches(), rho=RHO, steps=5, progress=False)
        runs[keep] = (res, sum(calls))
    (kept, passes_kept), (recomputed, passes) = runs[True], runs[False]
    assert passes_kept == passes - 2  # two batches
    assert kept.per_batch == recomputed.per_batch and kept.stationarity_gap == recomputed.stationarity_gap
    assert kept.breakdown == recomputed.breakdown


def test_the_clean_gradient_rule_counts_a_sixth_vector():
    """The clean point's gradient is kept where six vectors fit the goals that five do; at the bytes goal's edge the
    best point's gradient is kept and the clean point's is not."""
    from hf_geosharp.engine.solvers.memory import Footprint, keeps_best_gradient, keeps_clean_gradient

    room = Footprint(vector=100, space=0, parameters=100, weights=400, activations=10_000)
    assert keeps_best_gradient(room) and keeps_clean_gradient(room)
    edge = Footprint(vector=300, space=0, parameters=100, weights=400, activations=10_000)  # 1500 + 300 > 1568
    assert keeps_best_gradient(edge) and not keeps_clean_gradient(edge)
