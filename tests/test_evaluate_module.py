"""The evaluate face: registration, the literal ``evaluate.load("geodesic_sharpness")``, and ``compute`` matching the
Python API on tiny text (BERT), vision (ViT) and causal-LM (GPT-2) models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import evaluate
import pytest
import torch

import hf_geosharp as gs
from hf_geosharp.evaluate_module import register
from hf_geosharp.evaluate_module.measurement import GeodesicSharpness

from .fixtures.hf_models import one_thread, sentences, tiny_bert, tiny_tokenizer, tiny_vit  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
SETTINGS = dict(rho=0.05, mode="worst", steps=3, seed=0)


def _env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}  # fmt: skip


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([r + [value] * (width - len(r)) for r in rows])


def _text_data(tmp_path: Path, n: int = 10):
    texts, labels = sentences(n, seed=1)
    enc = tiny_tokenizer(tmp_path / "tok")(texts, truncation=True)
    return enc, labels


def _api_batches(enc, labels, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Batches built by hand (independently of hf_geosharp.data), padded to each batch's longest row."""
    batches = []
    for s in range(0, len(labels), batch_size):
        sl = slice(s, s + batch_size)
        batches.append({
            "input_ids": _pad(enc["input_ids"][sl], 0), "attention_mask": _pad(enc["attention_mask"][sl], 0),
            "token_type_ids": _pad(enc["token_type_ids"][sl], 0), "labels": torch.tensor(labels[sl]),
        })  # fmt: skip
    return batches


def test_import_writes_nothing(tmp_path):
    """``import hf_geosharp`` in a fresh process leaves an empty HF_HOME empty (registration is explicit only)."""
    hf_home = tmp_path / "hf"
    hf_home.mkdir()
    env = {**_env(hf_home), "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-c", "import hf_geosharp, hf_geosharp.cli; hf_geosharp.cli.build_parser()"],
        env=env,
        check=True,
        cwd=tmp_path,
    )
    assert list(hf_home.rglob("*")) == []


def test_register_is_idempotent_and_the_installed_version_wins(tmp_path, monkeypatch):
    from evaluate.loading import CachedEvaluationModuleFactory

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_MODULES_CACHE", raising=False)

    def resolved() -> str:
        modules = str(tmp_path / "modules/evaluate_modules")
        return CachedEvaluationModuleFactory(register.CACHE_FOLDER, dynamic_modules_path=modules).get_module().hash

    ours = register.register_evaluate_module()
    assert register.register_evaluate_module() == ours and ours.read_bytes() == register.SCRIPT.read_bytes()
    assert ours.is_relative_to(tmp_path / "modules/evaluate_modules/metrics")
    # another version registered later (an up- or downgrade): evaluate now picks that one ...
    now = ours.stat().st_mtime
    os.utime(ours, (now - 100, now - 100))
    other = ours.parents[1] / ("0" * 64) / ours.name
    other.parent.mkdir()
    other.write_text("raise ImportError('another version')\n")
    os.utime(other, (now - 10, now - 10))
    assert resolved() == "0" * 64
    # ... until this version registers again (as `geosharp register` does)
    register.register_evaluate_module()
    assert resolved() == ours.parent.name


def test_bare_name_loads_in_a_fresh_process_from_any_directory(tmp_path):
    """After ``geosharp register``, a process that never imported hf_geosharp loads the bare name offline."""
    hf_home, cwd = tmp_path / "hf", tmp_path / "elsewhere"
    cwd.mkdir()
    env = _env(hf_home)
    subprocess.run([sys.executable, "-m", "hf_geosharp", "register", "--quiet"], env=env, check=True, cwd=cwd)
    enc, labels = _text_data(tmp_path)
    (tmp_path / "data.json").write_text(json.dumps({"input_ids": enc["input_ids"], "labels": labels}))
    script = textwrap.dedent(f"""
        import json, sys
        import evaluate
        assert "hf_geosharp" not in sys.modules
        module = evaluate.load("geodesic_sharpness")
        cached = [m for m in sys.modules if "evaluate-measurement--geodesic_sharpness" in m]
        sys.path.insert(0, {str(REPO / "tests")!r})
        from fixtures.hf_models import tiny_bert
        data = json.load(open({str(tmp_path / "data.json")!r}))
        out = module.compute(model=tiny_bert(), **data, batch_size=4, metric="inv", baseline=False,
                             rho=0.05, steps=3, seed=0)
        print(json.dumps({{"class": type(module).__name__, "type": module.info.module_type, "cached": cached,
                          "value": out["geodesic_sharpness_inv"]}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["class"] == "GeodesicSharpness" and got["type"] == "measurement"
    assert got["cached"], "the module did not come from evaluate's module cache"
    batches = [{k: v for k, v in b.items() if k != "token_type_ids"} for b in _api_batches(enc, labels, 4)]
    expected = gs.geodesic_sharpness(tiny_bert(), batches, metric="inv", progress=False, **SETTINGS).value
    assert got["value"] == pytest.approx(expected, rel=1e-5)


def test_under_a_new_hf_home_the_path_loads_and_the_bare_name_error_is_the_one_the_docs_answer(tmp_path):
    """Under an HF_HOME where ``geosharp register`` never ran, evaluate's resolution of the bare name (the working
    directory, the Hub's ``evaluate-*`` orgs, then ``$HF_HOME/modules``) finds nothing and raises its own error, which
    nothing at import may change; the docs quote that error beside the fix (``geosharp register``), and the load by
    path (``gs.EVALUATE_MODULE_SCRIPT``) works there without registering."""
    hf_home = tmp_path / "fresh_hf_home"
    script = textwrap.dedent("""
        import sys
        import evaluate
        import hf_geosharp as gs
        try:
            evaluate.load("geodesic_sharpness")
        except Exception as err:
            print("bare:", type(err).__name__, err)
        module = evaluate.load(gs.EVALUATE_MODULE_SCRIPT)
        print("path:", type(module).__name__)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env={**_env(hf_home), "PYTHONPATH": str(REPO)},
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bare, path = [line for line in proc.stdout.splitlines() if line.startswith(("bare:", "path:"))]
    assert path == "path: GeodesicSharpness"
    quoted = ("Couldn't find a module script", "doesn't exist on the Hugging Face Hub either")
    if bare.startswith("bare: AttributeError"):
        # evaluate at its declared floor asks huggingface_hub for ``HfFolder`` (gone from the hub it resolves with)
        # on the way to the same failure: the bare name still does not load, and the load by path works.
        assert "HfFolder" in bare, bare
    else:
        assert bare.startswith("bare: FileNotFoundError"), bare
        assert all(part in bare for part in quoted), bare  # evaluate's words, as the docs quote them
    guide = " ".join((REPO / "docs" / "guide.md").read_text().split())
    answer = guide.split(quoted[0], 1)[1][:300]
    assert quoted[1] in answer and "`geosharp register`" in answer, answer
    readme = " ".join((REPO / "README.md").read_text().split())
    evaluate_section = readme.split('evaluate.load("geodesic_sharpness")', 1)[1][:400]
    assert "`geosharp register`" in evaluate_section and "HF_HOME" in evaluate_section
    assert not (hf_home / "modules" / "evaluate_modules" / "metrics" / register.CACHE_FOLDER).exists()


@pytest.fixture(scope="module")
def module_from_checkout_root():
    """The literal bare name from the repository root, after ``geosharp register``, resolves to this checkout's code
    (the root holds no folder of that name: the module's one folder is ``metric_card/``)."""
    register.register_evaluate_module()
    old = os.getcwd()
    os.chdir(REPO)
    try:
        module = evaluate.load("geodesic_sharpness", keep_in_memory=True)
    finally:
        os.chdir(old)
    assert type(module) is GeodesicSharpness  # the class this process imports from the checkout, not another copy
    return module


def test_module_dir_constant_loads_and_is_the_one_module_folder():
    module = evaluate.load(gs.EVALUATE_MODULE_SCRIPT)
    assert type(module).__name__ == "GeodesicSharpness"
    # one folder: the checkout's top-level metric_card/, with no bare-name copy or link beside it
    assert Path(gs.EVALUATE_MODULE_DIR).resolve() == REPO / "metric_card"
    assert not (REPO / "geodesic_sharpness").exists()
    assert register.SCRIPT.parent == Path(gs.EVALUATE_MODULE_DIR)
    assert Path(gs.EVALUATE_MODULE_SCRIPT) == register.SCRIPT and register.SCRIPT.is_file()
    card = (Path(gs.EVALUATE_MODULE_DIR) / "README.md").read_text()
    assert card.startswith("---\n")
    for section in ("## Measurement Description", "## How to Use", "### Inputs", "### Output Values",
                    "## Limitations and Bias", "## Citation"):  # fmt: skip
        assert section in card


def test_the_script_path_from_the_checkout_root_loads(monkeypatch):
    """``evaluate.load("metric_card/geodesic_sharpness.py")``: the published folder's script, by relative path."""
    monkeypatch.chdir(REPO)
    module = evaluate.load("metric_card/geodesic_sharpness.py", keep_in_memory=True)
    assert type(module) is GeodesicSharpness and module.module_type == "measurement"


def test_text_compute_equals_the_python_api(tmp_path, module_from_checkout_root):
    enc, labels = _text_data(tmp_path)
    model = tiny_bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = module_from_checkout_root.compute(
        model=model, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
        token_type_ids=enc["token_type_ids"], labels=labels, metric="inv,mix", batch_size=4, **SETTINGS,
    )  # fmt: skip
    batches = _api_batches(enc, labels, 4)
    for m in ("inv", "mix"):
        ref = gs.geodesic_sharpness(model, batches, metric=m, progress=False, **SETTINGS)
        assert out[f"geodesic_sharpness_{m}"] == pytest.approx(ref.value, rel=1e-6)
        assert out[f"geodesic_sharpness_{m}_per_batch"] == pytest.approx(ref.per_batch, rel=1e-6)
    ref = gs.adaptive_sharpness(model, batches, progress=False, **SETTINGS)
    assert out["adaptive_sharpness"] == pytest.approx(ref.value, rel=1e-6)
    assert out["clean_loss"] == pytest.approx(ref.clean_loss, rel=1e-6)
    assert len(out["clean_loss_per_batch"]) == 3 and out["config"]["n_examples"] == 10
    assert all(v >= 0 for v in out["geodesic_sharpness_inv_per_batch"]) and out["geodesic_sharpness_inv"] > 0
    assert "geodesic_sharpness" not in out  # one key per metric, whatever was asked for
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_vision_compute_equals_the_python_api(module_from_checkout_root):
    torch.manual_seed(1)
    pixels, labels = torch.randn(6, 3, 8, 8), [0, 1, 2, 0, 1, 2]
    model = tiny_vit()
    out = module_from_checkout_root.compute(
        model=model, pixel_values=pixels, labels=labels, metric="mix", batch_size=3, baseline=False, **SETTINGS
    )
    batches = [{"pixel_values": pixels[:3], "labels": torch.tensor(labels[:3])},
               {"pixel_values": pixels[3:], "labels": torch.tensor(labels[3:])}]  # fmt: skip
    ref = gs.geodesic_sharpness(model, batches, metric="mix", progress=False, **SETTINGS)
    assert out["geodesic_sharpness_mix"] == pytest.approx(ref.value, rel=1e-6)
    assert out["clean_loss_per_batch"] == pytest.approx(ref.per_batch_clean_loss, rel=1e-6)
    assert out["adaptive_sharpness"] is None and out["geodesic_sharpness_inv_per_batch"] is None  # not asked for


def test_causal_lm_labels_default_to_the_input_ids(module_from_checkout_root):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()
    ids = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    out = module_from_checkout_root.compute(model=model, input_ids=ids, batch_size=3, baseline=False, **SETTINGS)
    padded = _pad(ids, 0)
    mask = _pad([[1] * len(r) for r in ids], 0)
    batch = {"input_ids": padded, "attention_mask": mask, "labels": padded.masked_fill(mask == 0, -100)}
    ref = gs.geodesic_sharpness(model, [batch], progress=False, **SETTINGS)
    assert out["geodesic_sharpness_inv"] == pytest.approx(ref.value, rel=1e-6)


def test_add_and_add_batch_then_compute_and_clear_input_errors(tmp_path, module_from_checkout_root):
    enc, labels = _text_data(tmp_path, n=4)
    module = module_from_checkout_root
    module.add(input_ids=enc["input_ids"][0], labels=labels[0])
    module.add_batch(input_ids=enc["input_ids"][1:], labels=labels[1:])
    out = module.compute(model=tiny_bert(), batch_size=4, metric="inv", baseline=False, **SETTINGS)
    assert out["config"]["n_examples"] == 4 and len(out["geodesic_sharpness_inv_per_batch"]) == 1

    with pytest.raises(ValueError, match="labels= is missing"):
        module.compute(model=tiny_bert(), input_ids=enc["input_ids"])
    with pytest.raises(ValueError, match="exactly one of model="):
        module.compute(input_ids=enc["input_ids"], labels=labels)
    with pytest.raises(ValueError, match="metric='foo'"):
        module.compute(model=tiny_bert(), input_ids=enc["input_ids"], labels=labels, metric="foo")


def _saved_bert(folder: Path) -> Path:
    tiny_bert().save_pretrained(folder)
    tiny_tokenizer(folder).save_pretrained(folder)
    return folder


def test_raw_texts_with_model_id_equal_the_token_id_path(tmp_path, module_from_checkout_root):
    texts, labels = sentences(7, seed=4)
    folder = _saved_bert(tmp_path / "bert")
    kwargs = dict(labels=labels, measures="inv,adaptive", batch_size=3, **SETTINGS)
    from_text = module_from_checkout_root.compute(model_id=str(folder), predictions=texts, device="cpu", **kwargs)
    enc = tiny_tokenizer(tmp_path / "tok")(texts, truncation=True, max_length=128)
    from_ids = module_from_checkout_root.compute(model=tiny_bert(), **{k: enc[k] for k in enc}, **kwargs)
    with_tokenizer = module_from_checkout_root.compute(
        model=tiny_bert(), predictions=texts, tokenizer=tiny_tokenizer(tmp_path / "tok2"), **kwargs
    )
    for key in ("geodesic_sharpness_inv", "adaptive_sharpness", "clean_loss"):
        assert from_text[key] == pytest.approx(from_ids[key], rel=1e-6, abs=1e-12), key
        assert with_tokenizer[key] == pytest.approx(from_ids[key], rel=1e-6, abs=1e-12), key
    assert from_text["geodesic_sharpness_inv_per_batch"] == pytest.approx(from_ids["geodesic_sharpness_inv_per_batch"])
    assert from_text["config"]["n_batches"] == 3 and from_text["geodesic_sharpness_inv"] > 0


def _float_head_model(num_labels: int, problem_type: str):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(**tiny_bert().config.to_dict())
    # Set after construction: the keyword is overridden by the copied id2label in older transformers releases.
    config.num_labels, config.problem_type = num_labels, problem_type
    return BertForSequenceClassification(config).eval()


@pytest.mark.parametrize(
    ("num_labels", "problem_type", "labels"),
    [
        (1, "regression", [0.25, 1.75, -0.5, 2.5, 0.75, 1.25]),  # ints would truncate these: the loss would differ
        (3, "multi_label_classification", [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.0]] * 2),
    ],
)
def test_float_labels_keep_their_values(tmp_path, module_from_checkout_root, num_labels, problem_type, labels):
    enc, _ = _text_data(tmp_path, n=6)
    model = _float_head_model(num_labels, problem_type)
    out = module_from_checkout_root.compute(
        model=model, input_ids=enc["input_ids"], labels=labels, measures="inv", batch_size=3, **SETTINGS
    )
    batches = [
        {"input_ids": _pad(enc["input_ids"][s : s + 3], 0), "attention_mask": _pad(enc["attention_mask"][s : s + 3], 0),
         "labels": torch.tensor(labels[s : s + 3], dtype=torch.float32)}
        for s in (0, 3)
    ]  # fmt: skip
    ref = gs.geodesic_sharpness(model, batches, progress=False, **SETTINGS)
    assert out["clean_loss"] == pytest.approx(ref.clean_loss, rel=1e-6)
    assert out["geodesic_sharpness_inv"] == pytest.approx(ref.value, rel=1e-6, abs=1e-12)


def test_output_keys_are_stable_and_defaults_are_the_bundles(tmp_path, module_from_checkout_root):
    from hf_geosharp.measures import DEFAULT_MEASURES, MEASURES, Settings

    enc, labels = _text_data(tmp_path, n=4)
    data = dict(model=tiny_bert(), input_ids=enc["input_ids"], labels=labels, batch_size=4, steps=2)
    only_mix = module_from_checkout_root.compute(**data, measures="mix")
    default = module_from_checkout_root.compute(**data)
    expected = {f"{k}{s}" for k in MEASURES for s in ("", "_stderr", "_per_batch", "_certified")}
    assert set(only_mix) == set(default) == expected | {"clean_loss", "clean_loss_per_batch", "config"}
    assert only_mix["geodesic_sharpness_inv"] is None and only_mix["geodesic_sharpness_mix"] > 0
    assert only_mix["geodesic_sharpness_mix"] == default["geodesic_sharpness_mix"]
    assert all(default[k] is not None for k in DEFAULT_MEASURES)
    config = default["config"]
    assert config["measures"] == list(DEFAULT_MEASURES)
    defaults = Settings()
    assert (config["rho"], config["mode"], config["seed"], config["ball"]) == (
        defaults.rho, defaults.mode, defaults.seed, defaults.ball)
    paper = module_from_checkout_root.compute(**data, measures="mix", ball="paper")
    assert paper["config"]["ball"] == "paper" == paper["config"]["results"]["geodesic_sharpness_mix"]["config"]["ball"]
    assert paper["geodesic_sharpness_mix"] != only_mix["geodesic_sharpness_mix"]  # the ball is applied


def test_int_labels_of_a_classifier_and_the_clear_errors(tmp_path, module_from_checkout_root):
    from transformers import BertModel

    module = module_from_checkout_root
    enc, labels = _text_data(tmp_path, n=4)
    headless = tmp_path / "headless"
    BertModel(tiny_bert().config).save_pretrained(headless)
    tiny_tokenizer(headless).save_pretrained(headless)
    with pytest.raises(ValueError, match="BertModel has no supported task head") as err:
        module.compute(model_id=str(headless), predictions=["a good film"] * 4, labels=labels)
    assert "returned no loss" not in str(err.value)  # the cause, not "include labels"
    with pytest.raises(ValueError, match="label2id"):
        module.compute(model=tiny_bert(), input_ids=enc["input_ids"], labels=["pos", "neg", "pos", "neg"])
    with pytest.raises(ValueError, match="combine does not apply"):
        module.compute(model=tiny_bert(), predictions=["a"], references=[1])
    with pytest.raises(ValueError, match="pass the model's tokenizer="):
        module.compute(model=tiny_bert(), predictions=["a good film"], labels=[1])
    with pytest.raises(ValueError, match="never moves a model"):
        module.compute(model=tiny_bert(), input_ids=enc["input_ids"], labels=labels, device="meta")


def test_each_value_carries_its_certificate_at_the_top_level(tmp_path, module_from_checkout_root):
    """One solver step is not certified: ``<key>_certified`` is False at the top level (the value is a lower bound),
    as the engine's ``converged`` says; measures not asked for, and the average case, have None (no certificate)."""
    enc, labels = _text_data(tmp_path, n=4)
    data = dict(model=tiny_bert(), input_ids=enc["input_ids"], labels=labels, batch_size=4)
    with pytest.warns(gs.NotConvergedWarning):
        worst = module_from_checkout_root.compute(**data, measures="mix,adaptive", steps=1, rho=0.1)
    for key in ("geodesic_sharpness_mix", "adaptive_sharpness"):
        assert worst[f"{key}_certified"] is False is worst["config"]["results"][key]["converged"]
    assert worst["geodesic_sharpness_inv_certified"] is None and worst["relative_flatness_certified"] is None
    average = module_from_checkout_root.compute(**data, measures="adaptive", mode="average", n_samples=2)
    assert average["adaptive_sharpness"] is not None and average["adaptive_sharpness_certified"] is None


def test_inputs_are_checked_before_any_work(tmp_path, module_from_checkout_root):
    """Float token ids would be truncated by the int64 schema, a None label failed as "Could not infer dtype of
    NoneType", a tokenizer name as "'str' object is not callable": each is refused by name before evaluate stores
    anything or a model is loaded (model_id points nowhere: loading it would be a different error)."""
    module = module_from_checkout_root
    enc, labels = _text_data(tmp_path, n=4)
    nowhere = str(tmp_path / "no-such-model")
    floats = [[float(t) for t in row] for row in enc["input_ids"]]
    floats[2][1] += 0.7
    with pytest.raises(ValueError, match=r"input_ids\[0\] holds the float .*token ids and masks are integers"):
        module.compute(model_id=nowhere, input_ids=floats, labels=labels)
    with pytest.raises(ValueError, match=r"^input_ids holds a torch.float32 tensor"):
        module.compute(model_id=nowhere, input_ids=torch.tensor([[5.0, 6.0]]), labels=[1])
    with pytest.raises(ValueError, match=r"attention_mask\[1\] holds the float 1.0"):
        module.compute(model_id=nowhere, input_ids=enc["input_ids"][:2], attention_mask=[[1, 1], [1.0, 0]],
                       labels=labels[:2])
    with pytest.raises(ValueError, match=r"^labels\[1\] is None: every example needs its label"):
        module.compute(model_id=nowhere, input_ids=enc["input_ids"], labels=[1, None, 0, 1])
    with pytest.raises(ValueError, match=r"^labels\[0\] is None"):
        module.compute(model_id=nowhere, input_ids=enc["input_ids"][:1], labels=[[0, None]])
    with pytest.raises(TypeError, match=r"tokenizer= must be a tokenizer object \(e.g. AutoTokenizer.from_pretrained"
                                        r"\('bert'\)\), got str"):
        module.compute(model_id=nowhere, predictions=["a good film"], labels=[1], tokenizer="bert")
    with pytest.raises(ValueError, match=r"labels\[0\] is None"):
        module.add_batch(input_ids=enc["input_ids"][:1], labels=[None])
    with pytest.raises(ValueError, match=r"^input_ids holds the float 2.5"):
        module.add(input_ids=[1, 2.5], labels=1)
    module.add(input_ids=[1, 2], labels=1)  # integers pass
    assert module.compute(model=tiny_bert(), measures="adaptive", mode="average", n_samples=1)["adaptive_sharpness"]


def test_the_cached_version_notice_is_shown_once_and_importing_the_package_leaves_evaluates_logging_alone(tmp_path):
    """evaluate warns "Using the latest cached version ..." on every bare-name load from its cache. Importing
    hf_geosharp installs nothing on evaluate's logger (no side effect at import); once evaluate has built the module,
    its next loads in the process drop the notice, for this module only."""
    import logging

    env = _env(tmp_path / "hf")
    subprocess.run([sys.executable, "-m", "hf_geosharp", "register", "--quiet"], env=env, check=True, cwd=tmp_path)
    script = ("import logging, hf_geosharp; assert not logging.getLogger('evaluate.loading').filters; import evaluate; "
              "[evaluate.load('geodesic_sharpness') for _ in range(2)]; print('loaded')")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "loaded\n", proc.stderr[-2000:]
    assert proc.stderr.count("latest cached version") == 1, proc.stderr[-2000:]
    other = logging.LogRecord("evaluate.loading", logging.WARNING, __file__, 1, "Using the latest cached version of "
                              "the module from /x/evaluate-metric--accuracy/abc", None, None)  # fmt: skip
    register.quiet_cache_notice()
    assert logging.getLogger("evaluate.loading").filter(other)  # other modules' notices still pass
