"""The language-model zoo (hf_geosharp/lm_zoo.py): the mini zoo trains on the portable kernels, is cached and reused,
trains the same bits twice, loads offline with the Auto classes, and ``geosharp demo --zoo lm`` ranks it.

The emails are made up in the npm tarball's layout (the tests are offline and must not need the 20 MB corpus); the
byte tokenizer and the training are the real ones."""

from __future__ import annotations

import io
import json
import math
import random
import tarfile
from pathlib import Path

import pytest
import torch

from hf_geosharp import cli
from hf_geosharp.data import DataSpec, load_batches
from hf_geosharp.leaderboard.store import STORE_FILE
from hf_geosharp.lm_zoo import DATA, build_lm_zoo, cached_lm_members, lm_members
from hf_geosharp.text_corpus import EOS_ID, TARBALL, byte_tokenizer, encode_bytes, token_blocks
from hf_geosharp.zoo import METRICS_FILE

WORDS = ("offer free meeting project money click report team friday update price call now unsubscribe "
         "winner schedule invoice lunch deadline").split()


def fake_corpus(path: Path, n: int = 80) -> Path:
    """A tarball in the npm package's layout (package/data/<folder>/<id>.json, {"text": raw email})."""
    rng = random.Random(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for i in range(n):
            folder = ("easy-ham-1", "spam-1")[i % 2]
            body = " ".join(rng.choice(WORDS) for _ in range(20))
            raw = json.dumps({"text": f"From: someone@example.org\nSubject: note {i}\n\n{body}"}).encode()
            info = tarfile.TarInfo(f"package/data/{folder}/{i:04d}.json")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return fake_corpus(tmp_path_factory.mktemp("corpus") / TARBALL)


@pytest.fixture(scope="module")
def zoo(corpus, tmp_path_factory):
    return build_lm_zoo("mini", tmp_path_factory.mktemp("lm_zoo"), progress=False, tarball=corpus)


def test_the_byte_tokenizer_gives_each_byte_its_value_and_round_trips():
    text = "Subject: héllo 世界 \x00\x7f"
    ids = byte_tokenizer()(text)["input_ids"]
    assert ids == encode_bytes(text).tolist()
    assert byte_tokenizer().decode(ids) == text
    blocks, used = token_blocks(["ab", "cde"], 2, 3)
    assert blocks.tolist() == [[97, 98, EOS_ID], [99, 100, 101]] and used == 2


def test_the_mini_zoo_trains_finite_gaps_and_the_recipes_are_llama_shaped(zoo):
    metrics = zoo.metrics()
    assert sorted(metrics) == [m.name for m in lm_members("mini")]
    for m in metrics.values():
        assert all(math.isfinite(m[k]) for k in ("train_loss", "test_loss", "gap", "cpu_seconds"))
        assert m["gap"] == pytest.approx(m["test_loss"] - m["train_loss"])
        assert m["train_loss"] < math.log(257)  # better than uniform over the 257 tokens: it learnt something
    full = lm_members("full")
    assert len(full) >= 16 and len({(m.lr, m.weight_decay, m.steps, m.n_train, m.hidden) for m in full}) == len(full)
    assert all(m.n_train >= DATA["full"].n_common for m in full)  # every member trained on the measured blocks


def test_members_load_offline_with_the_auto_classes_and_the_data_with_the_leaderboard(zoo):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder = zoo.model_dirs[0]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_act) == (4, 2, "silu")
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.eos_token_id == EOS_ID and len(tokenizer) == cfg.vocab_size
    batches = load_batches(model, tokenizer, DataSpec(str(zoo.data_dir), split="test", n_examples=8, batch_size=4))
    assert [tuple(b["input_ids"].shape) for b in batches] == [(4, DATA["mini"].block)] * 2
    assert all(torch.equal(b["labels"], b["input_ids"]) for b in batches)
    with torch.no_grad():
        assert math.isfinite(float(model(**batches[0]).loss))


def test_a_second_build_trains_nothing_and_a_fresh_cache_trains_the_same_bits(zoo, corpus, tmp_path):
    before = {d.name: (d / METRICS_FILE).stat().st_mtime_ns for d in zoo.model_dirs}
    again = build_lm_zoo("mini", zoo.root, progress=False, tarball=corpus)
    assert {d.name: (d / METRICS_FILE).stat().st_mtime_ns for d in again.model_dirs} == before
    fresh = build_lm_zoo("mini", tmp_path / "fresh", progress=False, tarball=corpus)
    assert fresh.weights_digest() == zoo.weights_digest()
    assert {k: v["weights_digest"] for k, v in fresh.metrics().items()} == {
        k: v["weights_digest"] for k, v in zoo.metrics().items()}


def test_a_member_whose_fingerprint_is_stale_is_retrained_alone(zoo, corpus, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(zoo.root, root)
    metrics = root / zoo.members[0].name / METRICS_FILE
    record = json.loads(metrics.read_text())
    metrics.write_text(json.dumps({**record, "fingerprint": "stale"}))
    others = {m.name: (root / m.name / METRICS_FILE).stat().st_mtime_ns for m in zoo.members[1:]}
    assert cached_lm_members("mini", root) == [m.name for m in zoo.members[1:]]
    rebuilt = build_lm_zoo("mini", root, progress=False, tarball=corpus)
    assert json.loads(metrics.read_text())["weights_digest"] == record["weights_digest"]
    assert rebuilt.weights_digest() == zoo.weights_digest()
    assert {m: (root / m / METRICS_FILE).stat().st_mtime_ns for m in others} == others


def test_demo_zoo_lm_ranks_the_mini_zoo_end_to_end(zoo, corpus, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    fake_corpus(cache / "npm" / TARBALL)  # where the demo looks for the emails (else npm packs them)
    monkeypatch.setenv("HF_GEOSHARP_CACHE", str(cache))
    args = ["demo", "--zoo", "lm", "--size", "mini", "--out", str(tmp_path / "out"), "--n-examples", "8",
            "--batch-size", "8", "--steps", "2", "--rho-sweep", "none", "--measures", "inv,adaptive"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "| rank | model | geodesic_inv_worst | adaptive_clean_worst |" in out
    assert "Kendall tau" in out and "type: geodesic_sharpness" in out
    assert f"weights digest {zoo.weights_digest()}" in out  # the demo trained the same zoo in its own cache
    rows = (tmp_path / "out" / "leaderboard.csv").read_text().splitlines()
    assert len(rows) == 1 + len(zoo.members)
    store = (tmp_path / "out" / STORE_FILE).read_bytes()
    trained = {d.name: (cache / "lm_zoo" / d.name / METRICS_FILE).stat().st_mtime_ns for d in zoo.model_dirs}
    assert cli.main(args) == 0  # a rerun reuses the zoo and the results: it trains and measures nothing
    assert (tmp_path / "out" / STORE_FILE).read_bytes() == store
    assert {d.name: (cache / "lm_zoo" / d.name / METRICS_FILE).stat().st_mtime_ns for d in zoo.model_dirs} == trained


@pytest.mark.parametrize("padding", ["left", "right"])
def test_geodesic_sharpness_of_a_trained_decoder_is_invariant_under_its_symmetries(zoo, padding):
    """A trained member (rotary positions, grouped-query attention) in float64, moved by random elements of its
    symmetry group at condition 1e3 (the rotary commutant on the query-key pairs, GL on the value-output pairs with
    shared key-value heads): the same function, the same geodesic inv and mix to 1e-6, while adaptive sharpness
    moves. The batch has padded rows (``attention_mask`` zeros on the ``padding`` side, labels -100 there) and the
    model shifts its labels itself. (The default attention: transformers' eager attention gives NaN for a
    left-padded row, whose first queries see no key.)"""
    import copy

    from transformers import AutoModelForCausalLM

    import hf_geosharp as gs
    from hf_geosharp.symmetry.group_action import reparametrize

    model = AutoModelForCausalLM.from_pretrained(zoo.model_dirs[1], dtype=torch.float64).eval()
    batch = load_batches(model, None, DataSpec(str(zoo.data_dir), split="train", n_examples=4, batch_size=4))[0]
    mask = torch.ones_like(batch["input_ids"])
    cut = batch["input_ids"].shape[1] // 3
    for row in (1, 3):  # two padded rows
        if padding == "left":
            mask[row, :cut] = 0
        else:
            mask[row, -cut:] = 0
    labels = batch["labels"].masked_fill(mask == 0, -100)
    batches = [{"input_ids": batch["input_ids"], "attention_mask": mask, "labels": labels}]
    twin = copy.deepcopy(model)
    reparametrize(twin, seed=3, condition=1e3)
    moved = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), twin.parameters()))
    assert moved > 0.1
    with torch.no_grad():
        keep = mask.bool()
        assert torch.allclose(model(**batches[0]).logits[keep], twin(**batches[0]).logits[keep], rtol=1e-9, atol=1e-9)
        assert float(model(**batches[0]).loss) == pytest.approx(float(twin(**batches[0]).loss), rel=1e-10)
    common = dict(rho=0.1, steps=8, progress=False)
    for metric in ("inv", "mix"):
        a = gs.geodesic_sharpness(model, batches, metric=metric, **common)
        b = gs.geodesic_sharpness(twin, batches, metric=metric, **common)
        assert a.value > 0
        assert b.value == pytest.approx(a.value, rel=1e-6), metric
    ad_a = gs.adaptive_sharpness(model, batches, **common)
    ad_b = gs.adaptive_sharpness(twin, batches, **common)
    assert abs(ad_b.value - ad_a.value) > 0.05 * abs(ad_a.value)
