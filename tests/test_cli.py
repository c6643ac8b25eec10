"""``geosharp run`` and ``geosharp register`` end to end on tiny saved models and local data, the data loading behind
them, and the errors and exit codes scripts rely on (0 success, 1 failed run, 2 bad usage or input)."""

from __future__ import annotations

import json
import math

import datasets
import pytest
import torch

import hf_geosharp as gs
from hf_geosharp import cli
from hf_geosharp.data import (
    DataSpec, load_batches, load_model, load_processor, make_batches, resolve_columns, select_examples,
)  # fmt: skip

from .tiny_fixtures import one_thread  # noqa: F401
from .tiny_fixtures import save_text_model, save_vision_model, sentences, tiny_bert, tiny_tokenizer, write_csv
from .tiny_fixtures import write_imagefolder

FAST = ["--steps", "3", "--rho", "0.05"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {
        "bert": save_text_model(root / "bert"),
        "vit": save_vision_model(root / "vit"),
        "csv": write_csv(root / "reviews.csv", 40),
        "unlabelled": write_csv(root / "unlabelled.csv", 40, with_labels=False),
        "images": write_imagefolder(root / "images", per_class=3),
        "headless": _save_headless(root / "headless"),
        "root": root,
    }


def _save_headless(folder):
    """A BertModel (no task head, so no loss), saved with its tokenizer."""
    from transformers import BertModel

    BertModel(tiny_bert().config).save_pretrained(folder)
    tiny_tokenizer(folder).save_pretrained(folder)
    return folder


def geosharp(*argv) -> int:
    return cli.main([str(a) for a in argv])


def test_run_on_a_csv_prints_a_table_writes_json_and_matches_the_api(files, capsys):
    out = files["root"] / "out.json"
    code = geosharp("run", "--model", files["bert"], "--dataset", files["csv"], "--n-examples", 12, "--batch-size", 5,
                    *FAST, "--json", out)  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    measures = ["geodesic_inv_worst", "geodesic_mix_worst", "adaptive_clean_worst"]  # defaults: inv,mix + baseline
    assert list(report["results"]) == measures
    for name in measures:
        res = report["results"][name]
        assert len(res["per_batch"]) == 3 and all(v >= 0 for v in res["per_batch"]) and math.isfinite(res["value"])
        assert name in printed
    assert report["n_batches"] == 3 and report["world_size"] == 1 and report["data"]["n_examples"] == 12
    assert report["symmetry"]["n_pairs_qk"] == 8 and not report["symmetry"]["fallbacks"]

    spec = DataSpec(dataset=str(files["csv"]), n_examples=12, batch_size=5)
    model = load_model(str(files["bert"]))
    batches = load_batches(model, load_processor(str(files["bert"]), model), spec)
    ref = gs.geodesic_sharpness(model, batches, metric="mix", rho=0.05, steps=3, seed=0, progress=False)
    assert report["results"]["geodesic_mix_worst"]["value"] == pytest.approx(ref.value, rel=1e-6)


def test_run_on_an_imagefolder_and_a_saved_text_pair_dataset(files, capsys):
    code = geosharp("run", "--model", files["vit"], "--dataset", files["images"], "--n-examples", 6, "--batch-size", 3,
                    "--metric", "mix", "--no-baseline", "--quiet", *FAST)  # fmt: skip
    assert code == 0
    assert capsys.readouterr().out == ""  # --quiet: no table, no bars on stdout

    texts, labels = sentences(10)
    pairs = datasets.Dataset.from_dict(
        {"premise": texts, "hypothesis": texts[::-1], "gold": labels, "id": list(range(10))},
        features=datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                                    "gold": datasets.ClassLabel(names=["no", "yes"]), "id": datasets.Value("int64")}),
    )  # fmt: skip
    saved = files["root"] / "pairs"
    datasets.DatasetDict({"train": pairs}).save_to_disk(str(saved))
    out = files["root"] / "pairs.json"
    code = geosharp("run", "--model", files["bert"], "--dataset", saved, "--n-examples", 4, "--batch-size", 4,
                    "--metric", "inv", "--no-baseline", "--quiet", "--json", out, *FAST)  # fmt: skip
    assert code == 0
    assert list(json.loads(out.read_text())["results"]) == ["geodesic_inv_worst"]


def test_columns_are_found_by_type_and_name_and_pairs_are_encoded(files):
    ds = datasets.Dataset.from_dict(
        {"premise": ["a good film"], "hypothesis": ["bad"], "gold": [1], "label_text": ["yes"]},
        features=datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                                    "gold": datasets.ClassLabel(names=["no", "yes"]),
                                    "label_text": datasets.Value("string")}),
    )  # fmt: skip
    cols = resolve_columns(ds, DataSpec(dataset="x"), vision=False, need_labels=True)
    assert (cols.text, cols.text_pair, cols.label) == ("premise", "hypothesis", "gold")
    tok = tiny_tokenizer(files["root"] / "tok")
    enc = tok(["a good film"], ["bad"])
    assert 1 in enc["token_type_ids"][0]  # the pair really is encoded as a second segment


def test_selection_is_deterministic_and_documented(files):
    ds = datasets.load_dataset("csv", data_files=str(files["csv"]))["train"]
    first = select_examples(ds, DataSpec(dataset="x", n_examples=8, shuffle=False))
    assert first["review"] == ds["review"][:8]
    a = select_examples(ds, DataSpec(dataset="x", n_examples=8, seed=3))
    b = select_examples(ds, DataSpec(dataset="x", n_examples=8, seed=3))
    c = select_examples(ds, DataSpec(dataset="x", n_examples=8, seed=4))
    assert a["review"] == b["review"] and a["review"] != first["review"] and a["review"] != c["review"]


def test_batches_pad_per_batch_and_causal_labels_ignore_padding():
    batches = make_batches({"input_ids": [[5, 6, 7], [8], [9, 10]]}, 2, pad_token_id=1, task="causal-lm")
    assert [b["input_ids"].shape for b in batches] == [torch.Size([2, 3]), torch.Size([1, 2])]
    assert batches[0]["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batches[0]["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batches[0]["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]


def test_class_names_map_through_the_models_label2id(files, tmp_path):
    model = load_model(str(files["bert"]))
    tokenizer = load_processor(str(files["bert"]), model)
    csv = tmp_path / "named.csv"
    csv.write_text("text,label\nreally good,LABEL_1\nreally bad,label_0\n")
    spec = DataSpec(dataset=str(csv), n_examples=2, batch_size=2, shuffle=False)
    assert load_batches(model, tokenizer, spec)[0]["labels"].tolist() == [1, 0]

    # a ClassLabel whose names the model knows, in another order: matched by name, not by position
    model.config.id2label, model.config.label2id = {0: "ham", 1: "spam"}, {"ham": 0, "spam": 1}
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["SPAM", "HAM"])})
    datasets.Dataset.from_dict({"text": ["buy now", "hi mum"], "label": [0, 1]}, features).save_to_disk(tmp_path / "ds")
    spec = DataSpec(dataset=str(tmp_path / "ds"), n_examples=2, batch_size=2, shuffle=False)
    assert load_batches(model, tokenizer, spec)[0]["labels"].tolist() == [1, 0]


def test_a_masked_lm_needs_no_label_column(files, tmp_path):
    from transformers import BertForMaskedLM

    folder = tmp_path / "mlm"
    BertForMaskedLM(tiny_bert().config).save_pretrained(folder)
    tokenizer = tiny_tokenizer(folder)
    tokenizer.save_pretrained(folder)
    spec = DataSpec(dataset=str(files["unlabelled"]), n_examples=8, batch_size=4)
    model = load_model(str(folder))
    batches = load_batches(model, load_processor(str(folder), model), spec)
    for batch in batches:  # seeded masking: every row predicts at least one [MASK]ed token, and only those
        masked = batch["input_ids"] == tokenizer.mask_token_id
        assert masked.any(dim=1).all() and torch.equal(batch["labels"] != -100, masked)
    assert torch.equal(batches[0]["input_ids"], load_batches(model, tokenizer, spec)[0]["input_ids"])
    code = geosharp("run", "--model", folder, "--dataset", files["unlabelled"], "--n-examples", 8, "--batch-size", 4,
                    "--metric", "inv", "--no-baseline", "--quiet", *FAST)  # fmt: skip
    assert code == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"--dataset": "unlabelled"}, "no label column"),
        ({"--text-column": "nope"}, "--text-column 'nope' is not a column"),
        ({"--n-examples": "1000"}, "more examples than split 'train'"),
        ({"--split": "validation"}, "no split 'validation'"),
        ({"--model": "nobody/no-such-model-xyz"}, "the Hub is offline (HF_HUB_OFFLINE=1)"),
        ({"--dataset": "nobody/no-such-dataset-xyz"}, "the Hub is offline (HF_HUB_OFFLINE=1)"),
        ({"--model": "headless"}, "BertModel has no supported task head"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(files, capsys, overrides, message):
    argv = {"--model": files["bert"], "--dataset": files["csv"], "--n-examples": 8}
    argv.update({flag: files.get(value, value) for flag, value in overrides.items()})
    code = geosharp("run", *[x for kv in argv.items() for x in kv], *FAST)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and message in err


def test_bad_usage_exits_2(files, capsys):
    for argv in (["run", "--model", files["bert"]], ["run", "--model", files["bert"], "--dataset", files["csv"],
                                                     "--metric", "inv,euclid"]):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            geosharp(*argv)
        assert exc.value.code == 2
    assert "inv,euclid" in capsys.readouterr().err


def test_unmapped_attention_falls_back_and_says_why(files, capsys, tmp_path):
    from transformers import FunnelConfig, FunnelForSequenceClassification

    torch.manual_seed(0)
    model = FunnelForSequenceClassification(
        FunnelConfig(vocab_size=100, block_sizes=[1], d_model=32, n_head=4, d_head=8, d_inner=64, num_labels=2)
    )
    model.save_pretrained(tmp_path / "funnel")
    tiny_tokenizer(tmp_path / "funnel").save_pretrained(tmp_path / "funnel")
    code = geosharp("run", "--model", tmp_path / "funnel", "--dataset", files["csv"], "--n-examples", 4,
                    "--batch-size", 4, "--metric", "inv", "--no-baseline", "--quiet", *FAST)  # fmt: skip
    err = capsys.readouterr().err
    assert code == 0
    assert "warning: attention module 'funnel.encoder.blocks.0.0.attention' could not be mapped" in err
    assert "FunnelRelMultiheadAttention" in err and "perturbed elementwise" in err


def test_register_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_MODULES_CACHE", raising=False)
    assert geosharp("register") == 0
    target = next((tmp_path / "modules").rglob("geodesic_sharpness.py"))
    assert str(target) in capsys.readouterr().out
