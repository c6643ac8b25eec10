"""``geosharp run`` and ``geosharp register`` end to end on tiny saved models and local data, the data loading behind
them, and the errors and exit codes scripts rely on (0 success, 1 failed run, 2 bad usage or input)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import datasets
import pytest
import torch

import hf_geosharp as gs
from hf_geosharp import cli
from hf_geosharp.data import (
    DataSpec,
    load_batches,
    load_model,
    load_processor,
    make_batches,
    resolve_columns,
    select_examples,
)  # fmt: skip

from .fixtures.hf_models import (
    one_thread,  # noqa: F401
    save_text_model,
    save_vision_model,
    sentences,
    tiny_bert,
    tiny_tokenizer,
    write_csv,
    write_imagefolder,
)

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
    measures = ["geodesic_sharpness_inv", "geodesic_sharpness_mix", "adaptive_sharpness"]  # the bundle's defaults
    assert list(report["results"]) == measures
    for name in measures:
        res = report["results"][name]
        assert len(res["per_batch"]) == 3 and all(v >= 0 for v in res["per_batch"]) and math.isfinite(res["value"])
        assert res[name] == res["value"] and res[f"{name}_per_batch"] == res["per_batch"] and f"{name}_stderr" in res
        assert len(res["clean_loss_per_batch"]) == 3 and "per_batch_clean_loss" not in res  # one name everywhere
        assert name in printed and res["measure"] in printed
    assert report["higher_is_better"] == {name: False for name in measures}
    assert report["n_batches"] == 3 and report["world_size"] == 1 and report["data"]["n_examples"] == 12
    assert report["symmetry"]["n_pairs_qk"] == 8 and not report["symmetry"]["fallbacks"]

    spec = DataSpec(dataset=str(files["csv"]), n_examples=12, batch_size=5)
    model = load_model(str(files["bert"]))
    batches = load_batches(model, load_processor(str(files["bert"]), model), spec)
    ref = gs.geodesic_sharpness(model, batches, metric="mix", rho=0.05, steps=3, seed=0, progress=False)
    assert report["results"]["geodesic_sharpness_mix"]["value"] == pytest.approx(ref.value, rel=1e-6)


def test_run_on_an_imagefolder_and_a_saved_text_pair_dataset(files, capsys):
    code = geosharp("run", "--model", files["vit"], "--dataset", files["images"], "--n-examples", 6, "--batch-size", 3,
                    "--metric", "mix", "--no-baseline", "--quiet", *FAST)  # fmt: skip
    assert code == 0
    printed = capsys.readouterr()
    lines = printed.out.splitlines()  # --quiet and no results file: the table only, never silence
    assert lines[0].split()[:2] == ["measure", "sharpness"] and lines[2].startswith("geodesic_sharpness_mix")
    assert len(lines) == 3  # stderr holds at most the certificate's verdict (3 steps are not stationary here)
    assert all("is not converged after 3 steps" in line for line in printed.err.splitlines())

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
    assert list(json.loads(out.read_text())["results"]) == ["geodesic_sharpness_inv"]
    assert capsys.readouterr().out == ""  # --quiet with a results file: nothing on stdout


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
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["SPAM", "HAM"])}
    )
    saved = str(tmp_path / "ds")  # a str: datasets 2.x's save_to_disk does not take a Path
    datasets.Dataset.from_dict({"text": ["buy now", "hi mum"], "label": [0, 1]}, features).save_to_disk(saved)
    spec = DataSpec(dataset=saved, n_examples=2, batch_size=2, shuffle=False)
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


def test_n_examples_is_a_cap_and_numbers_read_well(files, capsys):
    out = files["root"] / "cap.json"
    code = geosharp("run", "--model", files["bert"], "--dataset", files["csv"], "--n-examples", 1000, "--batch-size",
                    64, "--metric", "inv", "--no-baseline", "--json", out, *FAST)  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "warning: --n-examples 1000 but split 'train'" in printed.err and "has 40 rows; using all 40" in printed.err
    report = json.loads(out.read_text())
    assert report["data"]["n_examples_used"] == 40 and report["n_batches"] == 1
    assert ": 40 examples in 1 batch of up to 64" in printed.out  # not "1 batches"
    n_params = sum(p.numel() for p in tiny_bert().parameters())
    assert f"{n_params:,} parameters" in printed.out and "," in f"{n_params:,}"
    assert "estimated " in printed.out and " s (from a timed first solver step per measure)" in printed.out


def test_device_and_dtype(files, capsys):
    out = files["root"] / "fp64.json"
    code = geosharp("run", "--model", files["bert"], "--dataset", files["csv"], "--n-examples", 8, "--batch-size", 4,
                    "--metric", "inv", "--no-baseline", "--device", "cpu", "--dtype", "float64", "--quiet",
                    "--json", out, *FAST)  # fmt: skip
    assert code == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["config"]["dtype"] == "torch.float64" and report["config"]["device"] == "cpu"
    spec = DataSpec(dataset=str(files["csv"]), n_examples=8, batch_size=4)
    model = load_model(str(files["bert"])).double()
    batches = load_batches(model, load_processor(str(files["bert"]), model), spec)
    ref = gs.geodesic_sharpness(model, batches, rho=0.05, steps=3, seed=0, progress=False)
    assert report["results"]["geodesic_sharpness_inv"]["value"] == pytest.approx(ref.value, rel=1e-9)
    assert geosharp("run", "--model", files["bert"], "--dataset", files["csv"], "--device", "nonsense") == 2
    assert "--device 'nonsense' is not usable" in capsys.readouterr().err


def test_results_file_carries_provenance_in_the_harness_layout(files, capsys):
    import datetime
    import hashlib
    from importlib.metadata import version

    folder = files["root"] / "results"
    code = geosharp("run", "--model", files["bert"], "--dataset", files["csv"], "--n-examples", 4, "--batch-size", 4,
                    "--metric", "inv", "--no-baseline", "--quiet", "--output-path", folder, "--ball", "paper",
                    *FAST)  # fmt: skip
    assert code == 0, capsys.readouterr().err
    (written,) = (folder / "bert").glob("results_*.json")  # DIR/<model>/results_<timestamp>.json
    report = json.loads(written.read_text())
    versions = report["versions"]
    for package in ("torch", "transformers", "datasets", "accelerate", "huggingface_hub"):
        assert versions[package] == version(package)
    assert versions["hf_geosharp"] == gs.__version__ and versions["python"].count(".") == 2
    date = datetime.datetime.fromisoformat(report["date"])
    assert date.tzinfo is not None and abs((datetime.datetime.now(datetime.timezone.utc) - date).total_seconds()) < 600
    weights = files["bert"] / "model.safetensors"
    assert report["model_source"]["weights_sha256"] == {
        "model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()
    }
    assert len(report["model_source"]["content"]) == 64
    assert report["environment"]["device"] == "cpu" and report["config"]["settings"]["steps"] == 3
    assert "n_samples" not in report["config"]["settings"]  # not a worst-case setting
    assert report["config"]["settings"]["ball"] == "paper"  # said explicitly, though a key would leave it out
    assert report["results"]["geodesic_sharpness_inv"]["config"]["ball"] == "paper"
    assert report["results"]["geodesic_sharpness_inv"]["geodesic_sharpness_inv_stderr"] is None  # one batch


def test_head_attaches_a_seeded_classifier_to_an_encoder(files, capsys):
    argv = ["run", "--model", files["headless"], "--dataset", files["csv"], "--n-examples", 6, "--batch-size", 3,
            "--metric", "inv", "--no-baseline", "--quiet", *FAST]  # fmt: skip
    assert geosharp(*argv) == 2 and "BertModel has no supported task head" in capsys.readouterr().err
    values = []
    for name in ("head1.json", "head2.json"):
        assert geosharp(*argv, "--head", "--num-labels", 2, "--json", files["root"] / name) == 0
        report = json.loads((files["root"] / name).read_text())
        values.append(report["results"]["geodesic_sharpness_inv"]["per_batch"])
    assert values[0] == values[1] and all(v > 0 for v in values[0])  # the head is the same: seeded
    assert report["config"]["head"] == {"num_labels": 2, "seed": 0}
    assert report["config"]["model_class"] == "BertForSequenceClassification"
    other = files["root"] / "head3.json"
    assert geosharp(*argv, "--head", "--seed", 1, "--json", other) == 0
    assert json.loads(other.read_text())["results"]["geodesic_sharpness_inv"]["per_batch"] != values[0]


def test_help_shows_the_defaults_of_the_bundle(capsys):
    from hf_geosharp.measures import Settings

    with pytest.raises(SystemExit):
        geosharp("run", "--help")
    text = " ".join(capsys.readouterr().out.split())
    defaults = Settings()
    for flag, value in (("--n-examples", 1024), ("--metric", "inv,mix"), ("--rho", defaults.rho),
                        ("--steps", defaults.steps), ("--seed", defaults.seed), ("--batch-size", 128)):  # fmt: skip
        assert f"(default: {value})" in text.split(flag, 2)[-1].split("--", 1)[0] or f"(default: {value})" in text


def test_logging_uses_one_library_handler_and_verbosity(files, capsys):
    import logging

    root_handlers = list(logging.getLogger().handlers)
    argv = ["run", "--model", files["bert"], "--dataset", files["csv"], "--n-examples", 4, "--batch-size", 4,
            "--metric", "inv", "--no-baseline", *FAST]  # fmt: skip
    assert geosharp(*argv) == 0
    quiet = capsys.readouterr().err
    assert "info:" not in quiet  # WARNING by default
    assert geosharp(*argv, "-v") == 0
    verbose = capsys.readouterr().err
    assert "info: geodesic_inv_worst: 16 GL pairs" in verbose
    assert "\n\n" not in verbose.replace("\r", "")  # no blank line after a log line
    assert logging.getLogger().handlers == root_handlers  # the root logger is never configured
    assert len(logging.getLogger("hf_geosharp").handlers) == 1  # one handler, also after several main() calls
    assert logging.getLogger("hf_geosharp").level == logging.INFO


def test_launcher_asking_for_more_processes_than_started_is_detected(monkeypatch):
    from hf_geosharp.pipeline import launch as run_command  # the launcher helper geosharp run asks

    accelerate_env = {"ACCELERATE_USE_CPU": "True"}
    cmdline = ["python", "accelerate", "launch", "--num_processes", "2", "--cpu", "-m", "hf_geosharp", "run"]
    assert run_command.asked_processes(accelerate_env, cmdline) == 2
    assert run_command.asked_processes(accelerate_env, ["accelerate", "launch", "--num_processes=3"]) == 3
    assert run_command.asked_processes({"WORLD_SIZE": "4"}, None) == 4
    assert run_command.asked_processes({}, cmdline) is None  # not under accelerate
    monkeypatch.setattr(run_command, "parent_cmdline", lambda: cmdline)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert "asked for 2 processes but 1 started" in run_command.launch_warning(1)
    assert run_command.launch_warning(2) is None


def test_third_party_log_lines_and_progress_bars_stay_out_of_the_output(tmp_path):
    """What `geosharp demo` does that other libraries report on (saving models, mapping datasets, matplotlib's font
    cache, transformers' advice), after the CLI's preparation: only our own lines come out."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from hf_geosharp import cli
        cli.prepare("demo", logging.INFO)
        import datasets, transformers
        from fixtures.hf_models import tiny_bert
        tiny_bert().save_pretrained({str(tmp_path / "m")!r})                      # "Writing model shards" bar
        datasets.Dataset.from_dict({{"x": list(range(5))}}).map(lambda r: r)       # "Map" bar
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        transformers.logging.get_logger("transformers.modeling_utils").warning("some advice")
        logging.getLogger("hf_geosharp.api").info("ours")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_GEOSHARP_NO_AUTOREGISTER": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "" and proc.stderr == "info: ours\n"


def test_measures_option_selects_by_key(files, capsys):
    out = files["root"] / "measures.json"
    code = geosharp("run", "--model", files["bert"], "--dataset", files["csv"], "--n-examples", 4, "--batch-size", 4,
                    "--measures", "adaptive,mix", "--quiet", "--json", out, *FAST)  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert list(json.loads(out.read_text())["results"]) == ["adaptive_sharpness", "geodesic_sharpness_mix"]
    with pytest.raises(SystemExit):
        geosharp("run", "--model", files["bert"], "--dataset", files["csv"], "--measures", "euclid")
    assert "unknown measure 'euclid'" in capsys.readouterr().err


def test_export_space_says_to_upload_to_the_space_id_given(tmp_path, monkeypatch, capsys):
    from hf_geosharp.commands import export_space

    monkeypatch.setattr(export_space, "export_space", lambda out, **kwargs: [])  # the folder itself: test_gradio_space
    assert cli.main(["export-space", str(tmp_path / "space"), "--space-id", "my-org/my-space"]) == 0
    said = capsys.readouterr().out
    assert f"hf upload my-org/my-space {tmp_path / 'space'} --repo-type space" in said and "OWNER" not in said
    assert cli.main(["export-space", str(tmp_path / "space")]) == 0
    assert "pass --space-id OWNER/NAME" in capsys.readouterr().out


def test_the_list_of_written_files_keeps_a_space_after_every_kind(monkeypatch, capsys):
    from types import SimpleNamespace

    from hf_geosharp.commands import board

    monkeypatch.setattr(board, "markdown", lambda _: "")
    paths = {"table": Path("out/leaderboard.md"), "sweep plot": Path("out/rho_sweep.png")}
    board.report(SimpleNamespace(sweep=None), paths)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    expected = [["table", str(paths["table"])], ["sweep", "plot", str(paths["sweep plot"])]]
    assert [row.split() for row in rows] == expected
    assert len({row.index("out/") for row in rows}) == 1  # one column
