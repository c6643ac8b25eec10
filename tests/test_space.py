"""The Hub Space: layout, the app through gradio_client, and a real headless browser (Debian's chromium)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from huggingface_hub import SpaceCard  # noqa: E402
from huggingface_hub.repocard_data import model_index_to_eval_results  # noqa: E402

from hf_geosharp.zoo import build_zoo, torch_threads  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPACE = ROOT / "spaces_demo"
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = ROOT / "artifacts" / "space_demo.png"


def _load_app():
    spec = importlib.util.spec_from_file_location("geosharp_space_app", SPACE / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def app():
    return _load_app()


@pytest.fixture(scope="module")
def url(app, tmp_path_factory):
    """The app launched in this process on the mini zoo (the session's shared zoo cache)."""
    zoo_dir = tmp_path_factory.getbasetemp() / "zoo"
    with torch_threads(1):
        build_zoo("mini", zoo_dir, progress=False)
    demo = app.build_demo("mini", zoo_dir, tmp_path_factory.mktemp("space"))
    demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        yield demo.local_url
    finally:
        demo.close()


def test_space_layout_serves_the_card_and_the_loading_script():
    # symlinks to the sources, so that the Space never drifts from them (upload_folder uploads their content)
    script = ROOT / "hf_geosharp" / "geodesic_sharpness" / "geodesic_sharpness.py"
    assert (SPACE / "geodesic_sharpness.py").resolve() == script
    assert (SPACE / "README.md").resolve() == ROOT / "metric_card" / "README.md"
    import gradio

    card = SpaceCard.load(SPACE / "README.md")
    assert card.data.sdk == "gradio" and card.data.app_file == "app.py" and (SPACE / card.data.app_file).is_file()
    assert card.data.sdk_version == gradio.__version__ and "measurement" in card.data.tags
    assert "# Measurement Card for Geodesic Sharpness" in card.text
    requirements = (SPACE / "requirements.txt").read_text()
    assert "hf_geosharp" in requirements and "evaluate" in requirements


def test_space_root_is_an_evaluate_loading_script():
    import evaluate

    module = evaluate.load(str(SPACE / "geodesic_sharpness.py"))
    assert type(module).__name__ == "GeodesicSharpness" and module.module_type == "measurement"


def test_measure_through_gradio_client(app, url):
    from gradio_client import Client

    client = Client(url, verbose=False)
    job = client.submit("mini-01", "", app.BUNDLED, "", "train", 64, 0.1, "mix", 2, api_name="/measure")
    table, report, plot, card_yaml, status = job.result(timeout=180)
    rows = {row[0]: row for row in table["data"]}
    assert table["headers"] == app.RESULT_COLUMNS and set(rows) == {"geodesic_mix_worst", "adaptive_as23_worst"}
    assert all(row[1] >= 0 and row[3] == 1 for row in rows.values())  # 64 examples: one batch of 64
    assert "2 QK, 2 VO" in report and plot["type"] == "matplotlib"
    name, entries = model_index_to_eval_results(yaml.safe_load(card_yaml)["model-index"])
    assert name == "mini-01" and {e.metric_config for e in entries} == set(rows)
    assert entries[0].metric_args["metric"] == "mix" and entries[0].metric_args["steps"] == 2
    assert "mini-01" in status


def test_bounds_and_offline_hub_give_clear_messages(app, url):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    client = Client(url, verbose=False)
    with pytest.raises(AppError, match="greater than maximum value 30"):
        client.predict("mini-00", "", app.BUNDLED, "", "train", 64, 0.1, "inv", 31, api_name="/measure")
    with pytest.raises(AppError, match="rho must be positive"):
        client.predict("mini-00", "", app.BUNDLED, "", "train", 64, 0.0, "inv", 2, api_name="/measure")
    with pytest.raises(AppError, match="Type a Hub model id"):
        client.predict(app.HUB, " ", app.BUNDLED, "", "train", 64, 0.1, "inv", 2, api_name="/measure")


def test_too_large_hub_model_is_refused_before_download(app, monkeypatch, tmp_path):
    import gradio as gr
    from huggingface_hub import HfApi

    monkeypatch.setattr(app, "hub_offline", lambda: False)
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kw: SimpleNamespace(
        safetensors=SimpleNamespace(total=7_000_000_000)))
    monkeypatch.setattr(app, "load_model", lambda *a: pytest.fail("downloaded a model that is too large"))
    space = app.Space("mini", tmp_path, tmp_path)
    with pytest.raises(gr.Error, match="7,000,000,000 parameters"):
        space.measure(app.HUB, "big/model", app.BUNDLED, "", "train", 64, 0.1, "inv", 2, progress=lambda *a, **k: None)


def test_rank_the_zoo_through_gradio_client(url):
    from gradio_client import Client

    board, taus, scatter = Client(url, verbose=False).predict(0.1, 1, api_name="/rank_zoo")
    assert [row[0] for row in board["data"]] == [1, 2, 3, 4]
    assert {"geodesic_inv_worst", "param_norm", "clean_loss", "gap"} <= set(board["headers"])
    assert "Kendall tau" in taus and Path(scatter).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: "
                    "apt-get install -y --no-install-recommends chromium fonts-dejavu-core")
def test_browser_click_compute_shows_the_result_table(url):
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip)")

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(url, wait_until="networkidle", timeout=60_000)
            playwright.expect(page.get_by_role("combobox", name="model")).to_have_value("mini-00")
            page.locator("#compute-btn").click()
            table = page.locator("#results-table")
            playwright.expect(table).to_contain_text("geodesic_inv_worst", timeout=120_000)
            playwright.expect(table).to_contain_text("adaptive_as23_worst")
            playwright.expect(page.locator("#status-out")).to_contain_text("mini-00")
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000


def test_hide_and_seek_through_gradio_client(app, url):
    from gradio_client import Client

    plot, status = Client(url, verbose=False).predict("mini-01", "adversarial: make it look sharp",
                                                      api_name="/hide_and_seek")
    assert plot["type"] == "matplotlib"
    geodesic, adaptive = status.split("Geodesic sharpness ")[1].split(";")[0], status.split("adaptive sharpness ")[1]
    g0, g1 = (float(v) for v in geodesic.split(" -> "))
    a0, a1 = (float(v.split(" ")[0]) for v in adaptive.split(" -> "))
    assert g1 == pytest.approx(g0, rel=1e-3) and a1 > 2 * a0


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: "
                    "apt-get install -y --no-install-recommends chromium fonts-dejavu-core")
def test_browser_hide_and_seek_tab_shows_the_chart(url):
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip)")

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1400})
            page.goto(url, wait_until="networkidle", timeout=60_000)
            page.get_by_role("tab", name="Hide & seek").click()
            page.locator("#hide-btn").click()
            playwright.expect(page.locator("#hide-status")).to_contain_text("adaptive sharpness", timeout=120_000)
            playwright.expect(page.locator("#hide-plot img, #hide-plot svg, #hide-plot canvas").first).to_be_visible()
        finally:
            browser.close()
