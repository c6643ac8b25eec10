"""Robustness of the command line: nothing of the user's is lost or damaged, no custom code runs without the flag, and
every bad input is a one-line error with exit code 2 before the work (never a traceback).

The expensive cases run in as few subprocesses as possible: one with a file-size limit (a full disk, simulated with
``resource.setrlimit``) for every writer, one with ``y`` piped into stdin for every command that loads a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hf_geosharp import cli

from .fixtures.hf_models import one_thread, save_text_model, write_csv  # noqa: F401  (one_thread: autouse)

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--n-examples", "8", "--batch-size", "4", "--steps", "2", "--rho", "0.05", "--quiet"]
BOARD_FAST = ["--n-examples", "8", "--batch-size", "4", "--steps", "2", "--measures", "adaptive", "--quiet"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def env(tmp: Path) -> dict[str, str]:
    """A child that finds this checkout first, runs offline on one thread, and caches modules under ``tmp``."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp / "modules")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("robustness-cli")
    return {"root": root, "model": save_text_model(root / "model"), "csv": write_csv(root / "reviews.csv", 12)}


def run_argv(files: dict, *extra: str) -> list[str]:
    return ["run", "--model", str(files["model"]), "--dataset", str(files["csv"]), *FAST, *extra]


# ------------------------------------------------------------------------------------------- usage and bad input
def test_epsilon_zero_is_accepted_and_a_negative_seed_is_a_usage_error(files, capsys):
    assert cli.main(run_argv(files, "--epsilon", "0", "--metric", "inv", "--no-baseline")) == 0
    with pytest.raises(SystemExit) as info:
        cli.main(run_argv(files, "--seed", "-1"))
    assert info.value.code == 2 and "--seed: must be an integer in 0..2**63-1" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["folder", "read-only"])
def test_json_paths_are_checked_before_the_measurement(files, tmp_path, capsys, kind):
    target = tmp_path / "out.json"
    if kind == "folder":
        target.mkdir()
    else:
        target.write_text('{"old": true}')
        target.chmod(0o444)
    start = time.perf_counter()
    assert cli.main(run_argv(files, "--steps", "200", "--json", str(target))) == 2
    assert time.perf_counter() - start < 30  # 200 steps per batch were never started
    err = capsys.readouterr().err
    assert ("is a folder" if kind == "folder" else "read-only") in err and "Traceback" not in err
    if kind == "read-only":
        assert target.read_text() == '{"old": true}'
    assert cli.main(["symmetry", str(files["model"]), "--json", str(target)]) == 2  # checked before loading
    assert ("is a folder" if kind == "folder" else "read-only") in capsys.readouterr().err


def test_an_unwritable_folder_is_refused_alike_by_json_and_output_path(files, tmp_path, capsys):
    """A folder marked read-only (mode 550; also when running as root, who could write it): --json and
    --output-path both refuse it before the measurement, and nothing is created in it (not even the sub-folder the
    results would go into)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o550)
    try:
        for flag, value in (("--json", locked / "out.json"), ("--output-path", locked)):
            start = time.perf_counter()
            assert cli.main(run_argv(files, "--steps", "200", flag, str(value))) == 2
            assert time.perf_counter() - start < 30  # 200 steps per batch were never started
            err = capsys.readouterr().err.strip()
            assert err.startswith("error: cannot write") and err.endswith("is not writable; choose another path."), err
            assert err.count("\n") == 0 and list(locked.iterdir()) == []
    finally:
        locked.chmod(0o750)


@pytest.mark.parametrize("extra", [["--measures", "eigenvalue", "--profile", "{tmp}"],
                                   ["--measures", "trace", "--profile", "{tmp}"],
                                   ["--measures", "relative", "--by-layer"],
                                   ["--mode", "average", "--by-layer"]],
                         ids=["eigenvalue-profile", "trace-profile", "relative-by-layer", "average-by-layer"])
def test_an_option_no_measure_can_serve_is_refused_before_the_measurement(files, tmp_path, capsys, extra):
    """--profile and --by-layer read a worst case's direction: with none among the measures the run is refused before
    any work (not after it, losing the results file), and the message names the fix."""
    out = tmp_path / "out.json"
    start = time.perf_counter()
    assert cli.main(run_argv(files, "--steps", "200", *[a.format(tmp=tmp_path) for a in extra], "--json",
                             str(out))) == 2
    assert time.perf_counter() - start < 30  # 200 steps per batch were never started
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and not out.exists(), err
    assert ("add inv, mix or adaptive to --measures" if "--measures" in extra else "use --mode worst") in err, err


def test_two_outputs_of_one_run_never_share_a_file(files, tmp_path, capsys):
    """--json onto the --profile figure, or onto a file the run reads (the dataset, the model's config): refused
    before any work, naming both; nothing is replaced."""
    figure = tmp_path / f"{files['model'].name}_profile.png"
    figure.write_bytes(b"\x89PNG old")
    config = files["model"] / "config.json"
    before = {path: digest(path) for path in (figure, config, files["csv"])}
    for target, named in ((figure, "--profile figure"), (config, "a file of --model"), (files["csv"], "--dataset")):
        start = time.perf_counter()
        assert cli.main(run_argv(files, "--steps", "200", "--metric", "inv", "--no-baseline", "--profile",
                                 str(tmp_path), "--json", str(target))) == 2
        assert time.perf_counter() - start < 30
        err = capsys.readouterr().err
        assert "--json" in err and named in err and "choose" in err and "Traceback" not in err, err
    assert {path: digest(path) for path in before} == before


def test_a_run_that_measured_writes_its_json_when_the_figure_fails(files, tmp_path, capsys, monkeypatch):
    """The figure is written after the results: when it fails (here an I/O error), the results file is there and
    the error says where, with exit 1."""
    from hf_geosharp import plots

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots, "save_figure", full_disk)
    out = tmp_path / "out.json"
    assert cli.main(run_argv(files, "--metric", "inv", "--no-baseline", "--profile", str(tmp_path / "figs"),
                             "--json", str(out))) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and f"the results are in {out}" in err, err
    assert "geodesic_sharpness_inv" in json.loads(out.read_text())["results"]


def test_reparametrize_refuses_an_out_that_holds_the_model(files, tmp_path, capsys):
    """OUT above MODEL with --overwrite would replace the folder holding MODEL: refused, MODEL intact."""
    parent = tmp_path / "parent"
    shutil.copytree(files["model"], parent / "model")
    before = digest(parent / "model" / "model.safetensors")
    assert cli.main(["reparametrize", str(parent / "model"), str(parent), "--overwrite"]) == 2
    assert "holds MODEL" in capsys.readouterr().err
    assert digest(parent / "model" / "model.safetensors") == before


@pytest.fixture(scope="module")
def damaged(files):
    """Copies of the model with truncated, zeroed and pickle weights."""
    out = {}
    for kind in ("truncated", "zeroed", "pickle"):
        folder = files["root"] / kind
        shutil.copytree(files["model"], folder)
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        if kind == "truncated":
            weights.write_bytes(data[: len(data) // 2])
        elif kind == "zeroed":
            weights.write_bytes(bytes(len(data)))
        else:
            weights.unlink()
            (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"not": "tensors", "code": print}))
        out[kind] = folder
    return out


@pytest.mark.parametrize("kind, message", [("truncated", "damaged"), ("zeroed", "damaged"),
                                           ("pickle", "never unpickles code")])
@pytest.mark.parametrize("command", ["run", "symmetry"])
def test_damaged_weights_are_a_clear_error(damaged, files, capsys, kind, message, command):
    folder = damaged[kind]
    argv = ["symmetry", str(folder)] if command == "symmetry" else [
        "run", "--model", str(folder), "--dataset", str(files["csv"]), *FAST]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_non_utf8_csv_names_the_line(files, tmp_path, capsys):
    bad = tmp_path / "latin1.csv"
    bad.write_bytes("review,label\ngood film,1\ncaf\xe9 awful,0\n".encode("latin-1"))
    assert cli.main(["run", "--model", str(files["model"]), "--dataset", str(bad), *FAST]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "line 3" in err and "iconv" in err


def test_token_positions_beyond_the_model_are_refused_with_the_flag_to_fix(files, tmp_path, capsys):
    long = tmp_path / "long.csv"
    long.write_text("review,label\n" + "".join(f"{'good film ' * 60},{i % 2}\n" for i in range(8)))
    assert cli.main(["run", "--model", str(files["model"]), "--dataset", str(long), *FAST, "--max-length", "200"]) == 2
    assert "--max-length 64" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- model cards
@pytest.fixture()
def run_json(files, tmp_path):
    path = tmp_path / "run.json"
    assert cli.main(run_argv(files, "--metric", "inv", "--no-baseline", "--json", str(path))) == 0
    return path


def _no_hub(monkeypatch) -> None:
    """Every way a model or a dataset could be looked up on the Hub fails the test."""
    import datasets
    import huggingface_hub
    import transformers

    def reached(*args, **kwargs):
        raise AssertionError(f"the Hub was asked for {args[:1]}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", reached)
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", reached)
    monkeypatch.setattr(datasets, "load_dataset", reached)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", reached)


@pytest.mark.parametrize("flag, value", [
    ("--model", "./my-bert"), ("--model", "/nowhere/my-bert"), ("--model", "~/nowhere/my-bert"),
    ("--model", "models/bert/checkpoint-500"), ("--dataset", "nothere.csv"), ("--dataset", "./data"),
    ("--dataset", "data/train.jsonl"),
])
def test_a_mistyped_local_path_is_said_at_once_without_the_hub(files, monkeypatch, capsys, flag, value):
    """A path that can only be local and does not exist: exit 2 and one line saying so, before anything is loaded
    (not a Hub id-format error, nor HTTP retries for a data file)."""
    _no_hub(monkeypatch)
    argv = run_argv(files)
    argv[argv.index(flag) + 1] = value
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: the {'model folder' if flag == '--model' else 'dataset'} {value!r} does not exist (no " \
        "such file or folder here); check the path. A Hub id looks like 'name' or 'org/name'."


@pytest.mark.parametrize("offline", [True, False])
def test_a_hub_id_this_machine_cannot_get_is_said_at_once_like_a_bad_path(files, monkeypatch, capsys, offline):
    """A placeholder such as PATH_OR_ID, not cached: offline, or with a Hub that cannot be reached (one lookup fails),
    it is the bad path's one line at once, never transformers' half minute of retries."""
    import huggingface_hub
    from huggingface_hub import constants

    _no_hub(monkeypatch)
    lookups = []

    def unreachable(repo_id, **kwargs):
        lookups.append(repo_id)
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    argv = run_argv(files)
    argv[argv.index("--model") + 1] = "PATH_OR_ID"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the model folder 'PATH_OR_ID' does not exist (no such file or folder here), and ")
    assert err.endswith("check the path. A Hub id looks like 'name' or 'org/name'.") and "\n" not in err
    assert ("HF_HUB_OFFLINE=1" in err) == offline and ("cannot be reached" in err) == (not offline)
    assert lookups == ([] if offline else ["PATH_OR_ID"])


def test_a_hub_id_in_the_cache_or_on_a_reachable_hub_goes_on_to_transformers(tmp_path, monkeypatch):
    """The check refuses only what cannot load: a cached id passes offline, a reachable one online, and a name that
    is no Hub id at all is the path message."""
    import huggingface_hub
    from huggingface_hub import constants

    from hf_geosharp.data import DataError, require_model

    snapshot = tmp_path / "models--org--cached" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--cached" / "refs").mkdir()
    (tmp_path / "models--org--cached" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    require_model("org/cached")
    with pytest.raises(DataError, match="not in the local Hugging Face cache"):
        require_model("org/other")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, **kwargs: object())
    require_model("org/other")
    with pytest.raises(DataError, match="not a Hub id either; check the path"):
        require_model("my model!")


@pytest.mark.parametrize("layout", ["folder", "script file", "hub"])
def test_a_dataset_loading_script_is_exit_2_and_one_line(files, tmp_path, monkeypatch, capsys, layout):
    """datasets no longer runs loading scripts: refused before anything runs, one line, no traceback."""
    import datasets

    if layout == "hub":  # what datasets raises for a Hub repo that holds a script (no network here)
        def scripted(*args, **kwargs):
            raise RuntimeError("Dataset scripts are no longer supported, but found scripted.py")

        monkeypatch.setattr(datasets, "load_dataset", scripted)
        source = "someone/scripted"
    else:
        folder = tmp_path / "mydata"
        folder.mkdir()
        (folder / "mydata.py").write_text("import datasets  # a loading script\n")
        shutil.copy(files["csv"], folder / "train.csv")
        source = str(folder if layout == "folder" else folder / "mydata.py")
    assert cli.main(run_argv(files, "--dataset", source)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert "is a loading script" in err and "convert the data to files" in err


def test_a_model_without_attention_says_geodesic_equals_adaptive(files, tmp_path, capsys):
    """A ResNet has no attention head pairs: nothing to quotient, so the three numbers are equal by construction,
    and the output says so once (equal numbers without a word would look like a fault)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    from .fixtures.hf_models import tiny_image_processor, write_imagefolder

    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1], num_labels=3)
    ResNetForImageClassification(config).save_pretrained(tmp_path / "resnet")
    tiny_image_processor().save_pretrained(tmp_path / "resnet")
    images = write_imagefolder(tmp_path / "images", per_class=3)
    out = tmp_path / "out.json"
    argv = ["run", "--model", str(tmp_path / "resnet"), "--dataset", str(images), "--n-examples", "8",
            "--batch-size", "4", "--steps", "2", "--rho", "0.05", "--quiet", "--json", str(out)]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    note = ("warning: the model has no attention head pairs (no GL(h) symmetry to quotient), so geodesic sharpness "
            "equals adaptive sharpness by construction.")
    assert err.count(note) == 1, err
    values = {k: r["value"] for k, r in json.loads(out.read_text())["results"].items()}
    assert len(values) == 3 and len(set(values.values())) == 1, values
    assert cli.main(run_argv(files, "--metric", "inv")) == 0  # a model with attention: no such note
    assert "no attention head pairs" not in capsys.readouterr().err


def test_card_refuses_any_target_but_a_model_folder_or_its_readme(files, tmp_path, run_json, capsys):
    model = tmp_path / "model"
    shutil.copytree(files["model"], model)
    config = digest(model / "config.json")
    for target in (model / "config.json", model / "notes.md", tmp_path / "card.txt"):
        assert cli.main(["card", str(target), "--results", str(run_json)]) == 2
        assert "neither a model folder nor a README.md" in capsys.readouterr().err
    assert digest(model / "config.json") == config and not (tmp_path / "card.txt").exists()
    assert cli.main(["card", str(model), "--results", str(run_json)]) == 0
    assert (model / "README.md").is_file()


@pytest.mark.parametrize("front, message", [("tags: [a, b\nfoo: : bar\n", "cannot be read"),
                                            ("- a\n- b\n", "cannot be read")])
def test_card_refuses_unreadable_front_matter_and_leaves_it(tmp_path, run_json, capsys, front, message):
    readme = tmp_path / "m" / "README.md"
    readme.parent.mkdir()
    readme.write_text(f"---\n{front}---\n\n# My model\n\nProse the user wrote.\n")
    before = digest(readme)
    assert cli.main(["card", str(readme), "--results", str(run_json)]) == 2
    err = capsys.readouterr().err
    assert message in err and "front matter" in err and "Traceback" not in err
    assert digest(readme) == before


@pytest.mark.parametrize("bom, newline", [("\ufeff", "\n"), ("", "\r\n"), ("\ufeff", "\r\n"), ("", "\n")],
                         ids=["bom", "crlf", "bom-crlf", "plain"])
def test_card_reads_front_matter_as_huggingface_hub_does(tmp_path, run_json, capsys, bom, newline):
    """A README saved by a Windows editor (byte-order mark, CRLF): the user's metadata stays in the one front
    matter, next to the new entries; the body is byte for byte what it was, line endings included."""
    from huggingface_hub import metadata_load

    body = newline.join(["", "# My model", "", "Prose the user wrote.", "---", "a rule, not front matter", ""])
    readme = tmp_path / "m" / "README.md"
    readme.parent.mkdir()
    readme.write_bytes((bom + newline.join(["---", "license: mit", "tags:", "- mine", "---"]) + body).encode())
    assert cli.main(["card", str(readme.parent), "--results", str(run_json)]) == 0
    assert "metadata block was not found" not in capsys.readouterr().err
    written = readme.read_bytes().decode()
    meta = metadata_load(readme)
    assert meta["license"] == "mit" and meta["tags"] == ["mine"] and meta["model-index"]
    assert written.startswith("---" + newline) and written.endswith(body)  # one front matter, the body untouched
    assert written.count("license: mit") == 1 and written.count(newline + "---" + newline) == 2
    if newline == "\r\n":
        assert "\n" not in written.replace("\r\n", "")  # no bare LF slipped in


@pytest.mark.parametrize("text, message", [
    (b"---\nlicense: mit\n\n# no closing line\n", "huggingface_hub does not read a front matter"),
    (b"---\nlicense: caf\xe9\n---\n# latin-1\n", "is not UTF-8 text"),
], ids=["unclosed", "latin-1"])
def test_card_refuses_a_readme_huggingface_hub_cannot_read_and_leaves_it(tmp_path, run_json, capsys, text, message):
    readme = tmp_path / "m" / "README.md"
    readme.parent.mkdir()
    readme.write_bytes(text)
    assert cli.main(["card", str(readme), "--results", str(run_json)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Nothing was written" in err and "Traceback" not in err
    assert readme.read_bytes() == text


def test_card_refuses_non_finite_values(tmp_path, run_json, capsys):
    payload = json.loads(run_json.read_text())
    for result in payload["results"].values():
        result["value"] = float("nan")
    bad = tmp_path / "nan.json"
    bad.write_text(json.dumps(payload))
    assert cli.main(["card", str(tmp_path / "m"), "--results", str(bad)]) == 2
    assert not (tmp_path / "m" / "README.md").exists()
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- a full disk
def test_a_failed_write_keeps_every_previous_file(files, tmp_path):
    """Each writer once without a limit (the previous, good files), then under a file-size limit of half each file's
    size: the command fails with exit 1 and a message, and the previous file is byte-identical."""
    out = tmp_path / "out.json"
    sym = tmp_path / "symmetry.json"
    board = tmp_path / "board"
    card = tmp_path / "card-model"
    shutil.copytree(files["model"], card)
    (card / "README.md").write_text("---\nlicense: mit\n---\n\n# Card\n\n" + "The user's prose. " * 3500)
    commands = {
        "run": (run_argv(files, "--json", str(out)), out),
        "symmetry": (["symmetry", str(files["model"]), "--json", str(sym)], sym),
        "leaderboard": (["leaderboard", str(files["model"]), "--dataset", str(files["csv"]), *BOARD_FAST,
                         "--out", str(board)], board / "leaderboard.md"),
    }
    for argv, _ in commands.values():
        assert cli.main(argv) == 0
    commands["card"] = (["card", str(card), "--results", str(out)], card / "README.md")
    before = {name: (path, digest(path), path.stat().st_size) for name, (_, path) in commands.items()}
    plan = [(before[name][2] // 2, argv) for name, (argv, _) in commands.items()]
    script = textwrap.dedent(f"""
        import json, resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        from hf_geosharp import cli
        codes = []
        for limit, argv in {plan!r}:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            codes.append(cli.main(argv))
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print(json.dumps(codes))
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [1, 1, 1, 1], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("unchanged") >= 4, proc.stderr[-3000:]
    for name, (path, sha, _) in before.items():
        assert digest(path) == sha, name
        assert not [p for p in path.parent.iterdir() if p.name.startswith(".") and ".tmp" in p.name], name


# ------------------------------------------------------------------------------------------- custom code
def remote_code_folder(files: dict, where: Path, marker: Path, part: str) -> Path:
    """A model folder whose config (or tokenizer) names a custom module that writes ``marker`` when imported."""
    folder = where / f"custom-{part}"
    shutil.copytree(files["model"], folder)
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('custom code ran')\n"
    if part == "config":
        (folder / "marker_config.py").write_text(code + "from transformers import BertConfig\n\n\n"
                                                "class MarkerConfig(BertConfig):\n    model_type = 'marker-custom'\n")
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="marker-custom", auto_map={"AutoConfig": "marker_config.MarkerConfig"})
        (folder / "config.json").write_text(json.dumps(config))
    else:
        (folder / "marker_tokenizer.py").write_text(code + "from transformers import BertTokenizerFast\n\n\n"
                                                   "class MarkerTokenizer(BertTokenizerFast):\n    pass\n")
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(tokenizer_class="MarkerTokenizer",
                      auto_map={"AutoTokenizer": [None, "marker_tokenizer.MarkerTokenizer"]})
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_custom_code_never_runs_without_the_flag_even_with_y_on_stdin(files, tmp_path):
    marker = tmp_path / "MARKER"
    by_config = remote_code_folder(files, tmp_path, marker, "config")
    by_tokenizer = remote_code_folder(files, tmp_path, marker, "tokenizer")
    csv = str(files["csv"])
    plan = [
        ["run", "--model", str(by_config), "--dataset", csv, *FAST],
        ["run", "--model", str(by_tokenizer), "--dataset", csv, *FAST],
        ["symmetry", str(by_config)],
        ["leaderboard", str(by_config), "--dataset", csv, *BOARD_FAST, "--out", str(tmp_path / "board")],
    ]
    script = textwrap.dedent(f"""
        import json, os
        from hf_geosharp import cli
        refused = [cli.main(argv) for argv in {plan!r}]
        ran = os.path.exists({str(marker)!r})
        allowed = cli.main(["symmetry", {str(by_config)!r}, "--trust-remote-code"])  # the flag: the one way in
        print(json.dumps([refused, ran, allowed]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=env(tmp_path), input="y\n" * 20,
                          capture_output=True, text=True, timeout=600)
    refused, ran, allowed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert refused == [2, 2, 2, 2] and not ran, proc.stderr[-3000:]
    assert proc.stderr.count("--trust-remote-code") >= 4 and "[y/N]" not in proc.stdout + proc.stderr
    assert allowed == 0 and marker.read_text() == "custom code ran"


def test_python_side_needs_trust_remote_code_too(files, tmp_path):
    from hf_geosharp.data import DataError, load_model

    marker = tmp_path / "MARKER"
    folder = remote_code_folder(files, tmp_path, marker, "config")
    with pytest.raises(DataError, match="trust_remote_code=True"):
        load_model(str(folder))
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- Ctrl-C
@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_exits_130_with_one_line_and_keeps_finished_measures(files, tmp_path):
    """SIGINT once the first measure has finished (the baseline's bar shows up on stderr, which --progress asks for
    where stderr is a pipe): exit 130, one line naming what was kept, no traceback; the finished measure is in --json,
    marked interrupted."""
    out = tmp_path / "out.json"
    argv = ["run", "--model", str(files["model"]), "--dataset", str(files["csv"]), "--n-examples", "8",
            "--batch-size", "4", "--steps", "300", "--metric", "inv", "--json", str(out), "--progress"]
    proc = subprocess.Popen([sys.executable, "-m", "hf_geosharp", *argv], env=env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    seen = b""
    deadline = time.monotonic() + 300
    while b"adaptive" not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += os.read(proc.stderr.fileno(), 4096)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = (seen + err).decode()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted (Ctrl-C)" in err
    payload = json.loads(out.read_text())
    assert payload.get("interrupted") is True and list(payload["results"]) == ["geodesic_sharpness_inv"]


def test_ctrl_c_in_any_command_is_exit_130(files, monkeypatch, capsys):
    import hf_geosharp.commands.symmetry as symmetry

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(symmetry, "symmetry_map", interrupted)
    assert cli.main(["symmetry", str(files["model"])]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted (Ctrl-C); nothing was written." and "Traceback" not in err


def test_torch_is_untouched_by_the_cli(files):
    """The commands change no global torch state the caller could notice (grad mode, RNG)."""
    state = torch.get_rng_state()
    assert cli.main(run_argv(files, "--metric", "inv", "--no-baseline")) == 0
    assert torch.is_grad_enabled() and torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------------------- Ctrl-C and kills of the demo
def _processes_following(pid: int) -> list[int]:
    """The training children started by process ``pid`` (they name it in their command line), still alive."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if f"_follow_parent({pid})".encode() in cmdline:
            found.append(int(entry.name))
    return found


def _demo(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    cache = tmp_path / "zoo"
    argv = ["demo", "--size", "mini", "--cache-dir", str(cache), "--out", str(tmp_path / "out"), "--quiet",
            "--no-hide-seek", "--n-examples", "16", "--batch-size", "8", "--steps", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "hf_geosharp", *argv], env=env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)  # its own group: a terminal's Ctrl-C
    return proc, cache


def _wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the demo ended before {what}: {proc.communicate()[1].decode()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("presses", [1, 2], ids=["once", "twice"])
def test_ctrl_c_while_the_zoo_trains_keeps_finished_members_and_leaves_nothing_half_done(tmp_path, presses):
    """Ctrl-C (to the whole process group, as a terminal sends it; twice in quick succession too) once the first
    member is saved: exit 130, one line saying exactly which members stay cached, no hidden staging folder, no
    training child left, no traceback (a second Ctrl-C must not surface as torch's "trying to pop from empty mode
    stack"); a rerun reuses the finished members."""
    from hf_geosharp.zoo import METRICS_FILE, build_zoo, cached_members

    proc, cache = _demo(tmp_path)
    _wait_for(lambda: (cache / "mini-00" / METRICS_FILE).exists() and _processes_following(proc.pid), proc,
              "first trained member")
    for _ in range(presses):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    kept = cached_members("mini", cache)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "mode stack" not in err and "nothing was written" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted (Ctrl-C); ") and f"{len(kept)} of the 4 zoo models are trained" in last
    assert f"({', '.join(kept)})" in last and str(cache) in last and "mini-00" in kept
    assert not list(cache.glob(".*-new-*")), list(cache.iterdir())
    assert not _processes_following(proc.pid)
    mtimes = {name: (cache / name / METRICS_FILE).stat().st_mtime_ns for name in kept}
    build_zoo("mini", cache, progress=False, names=kept)  # the finished members are reused as they are
    assert {name: (cache / name / METRICS_FILE).stat().st_mtime_ns for name in kept} == mtimes


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
def test_the_training_child_dies_with_a_killed_demo_and_a_rerun_removes_stale_staging(tmp_path):
    """SIGKILL of the demo (nothing of it runs any more): its training child notices within a second, removes its
    staging folder and exits; a staging folder left anyway (a kill of both) is removed by the next build."""
    from hf_geosharp.zoo import build_zoo

    proc, cache = _demo(tmp_path)
    _wait_for(lambda: _processes_following(proc.pid) and list(cache.glob(".mini-*-new-*")), proc, "training child")
    children = _processes_following(proc.pid)
    proc.kill()
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while _processes_following(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_following(proc.pid), f"training child {children} outlived the killed demo"
    assert not list(cache.glob(".mini-*-new-*"))
    stale = cache / ".mini-02-new-x1y2z3"
    (stale / "sub").mkdir(parents=True)
    build_zoo("mini", cache, progress=False, names=["mini-00"])
    assert not stale.exists()


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_while_the_process_exits_says_the_command_had_finished(files, tmp_path):
    """A Ctrl-C after ``reparametrize`` wrote OUT and printed its result, while the process exits (held open here by
    a slow exit handler), ends with one line saying the work is complete, exit 130, never a silent kill (Python's
    signal handling is off while modules are torn down, which ``geosharp`` skips)."""
    out = tmp_path / "moved"
    code = ("import atexit, sys, time; atexit.register(time.sleep, 30); "
            f"sys.argv = ['geosharp', 'reparametrize', {str(files['model'])!r}, {str(out)!r}]; "
            "from hf_geosharp.cli import main; main()")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    seen = b""
    deadline = time.monotonic() + 300
    while b"reparametrized" not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += os.read(proc.stdout.fileno(), 4096)
    time.sleep(0.5)  # the command has returned; the process is in its exit handlers
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 130 and time.monotonic() - start < 10, err[-3000:]
    assert err.strip().splitlines()[-1] == (f"interrupted (Ctrl-C) while exiting, after the command had finished; the "
                                            f"new copy in {out} is complete.")
    assert (out / "config.json").exists() and "Traceback" not in err
