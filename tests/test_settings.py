"""One settings object, checked once, with every default written once (hf_geosharp.engine.defaults): the public
functions, the engine's layers, the registry's Settings and the command lines all start from the same values, and a
bad setting is refused before any work, on every path (the runner, single-process or sharded, is never reached)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import hf_geosharp as gs
import hf_geosharp.api as api
from hf_geosharp.cli import build_parser
from hf_geosharp.engine import defaults
from hf_geosharp.engine.geometry.gl_quotient import gl_quotient
from hf_geosharp.engine.settings import RunSettings
from hf_geosharp.engine.solvers.apgd import apgd
from hf_geosharp.engine.solvers.as23 import apgd_as23
from hf_geosharp.engine.solvers.average import average_case
from hf_geosharp.engine.space.perturbation_space import SpaceOptions
from hf_geosharp.integrations import GeodesicSharpnessCallback, measure_trainer
from hf_geosharp.measures import Settings

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import FAST, assert_intact, snapshot, tiny_batches, tiny_bert

#: Each keyword of the public functions and the constant that is its default.
API_DEFAULTS = {"rho": defaults.RHO, "mode": defaults.MODE, "steps": defaults.STEPS, "seed": defaults.SEED,
                "n_samples": defaults.N_SAMPLES, "params": defaults.PARAMS}
GEODESIC_DEFAULTS = {"epsilon": defaults.EPSILON, "metric": defaults.METRIC, "ball": defaults.BALL,
                     "step_normalization": defaults.STEP_NORMALIZATION,
                     "elementwise_curvature": defaults.ELEMENTWISE_CURVATURE}


def _defaults(function) -> dict:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_the_public_functions_default_to_the_constants():
    assert _defaults(gs.geodesic_sharpness).items() >= {**API_DEFAULTS, **GEODESIC_DEFAULTS}.items()
    assert _defaults(gs.adaptive_sharpness).items() >= {**API_DEFAULTS, "variant": defaults.ADAPTIVE_VARIANT}.items()


def test_the_engine_defaults_to_the_constants():
    run = RunSettings(rho=defaults.RHO)
    assert (run.mode, run.steps, run.seed, run.n_samples, run.params, run.step_normalization) == (
        defaults.MODE, defaults.STEPS, defaults.SEED, defaults.N_SAMPLES, defaults.PARAMS, defaults.STEP_NORMALIZATION)
    assert run.variant == defaults.ADAPTIVE_VARIANT  # adaptive sharpness (no space options) with the default solver
    options = SpaceOptions()
    assert (options.metric, options.epsilon, options.elementwise_curvature, options.ball) == (
        defaults.METRIC, defaults.EPSILON, defaults.ELEMENTWISE_CURVATURE, defaults.BALL)
    assert _defaults(gl_quotient)["epsilon"] == defaults.EPSILON and _defaults(gl_quotient)["metric"] == defaults.METRIC
    assert _defaults(apgd)["steps"] == _defaults(apgd_as23)["steps"] == defaults.BLOCK_STEPS
    assert defaults.STEPS == "auto"  # every face measures until certified unless told otherwise
    assert _defaults(apgd)["step_normalization"] == defaults.STEP_NORMALIZATION
    assert _defaults(average_case)["n_samples"] == defaults.N_SAMPLES


def test_every_face_defaults_to_the_constants():
    bundle = Settings()
    assert bundle.as_dict() == {"rho": defaults.RHO, "mode": defaults.MODE, "steps": defaults.STEPS,
                                "n_samples": defaults.N_SAMPLES, "seed": defaults.SEED, "epsilon": defaults.EPSILON,
                                "ball": defaults.BALL, "adaptive_variant": defaults.ADAPTIVE_VARIANT}
    parser = build_parser()
    run = parser.parse_args(["run", "--model", "m", "--dataset", "d"])
    board = parser.parse_args(["leaderboard", "m", "--dataset", "d"])
    demo = parser.parse_args(["demo"])
    for args in (run, board, demo):
        assert (args.rho, args.steps, args.n_samples, args.seed, args.epsilon, args.ball) == (
            bundle.rho, bundle.steps, bundle.n_samples, bundle.seed, bundle.epsilon, bundle.ball)
    assert run.mode == bundle.mode and board.mode == demo.mode == [bundle.mode]
    hide = parser.parse_args(["reparametrize", "m", "out"])
    assert (hide.rho, hide.seed) == (bundle.rho, bundle.seed)
    assert _defaults(GeodesicSharpnessCallback)["seed"] == _defaults(measure_trainer)["seed"] == defaults.SEED


def test_help_texts_show_the_constants(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["leaderboard", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, value in (("--rho", defaults.RHO), ("--steps", defaults.STEPS), ("--n-samples", defaults.N_SAMPLES),
                        ("--epsilon", defaults.EPSILON), ("--seed", defaults.SEED), ("--mode", defaults.MODE)):
        assert f"(default: {value})" in text.split(f"{flag} ", 2)[-1].split("--", 1)[0], flag


@pytest.mark.parametrize("measure", [gs.geodesic_sharpness, gs.adaptive_sharpness], ids=["geodesic", "adaptive"])
def test_an_unknown_params_is_refused_before_any_work(measure, monkeypatch):
    """``params="Trainable"`` once meant "all" on the sharded path: it is refused when the settings are made, before
    the runner picks a placement, so no path can read it differently."""

    def runner_reached(*args, **kwargs):
        raise AssertionError("the runner was reached with settings that should have been refused")

    monkeypatch.setattr(api, "run", runner_reached)
    model = tiny_bert()
    forwards = []
    model.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"params must be 'all' or 'trainable', got 'Trainable'\."):
        measure(model, tiny_batches(), params="Trainable", **FAST)
    assert not forwards
    assert_intact(model, before)


@pytest.mark.parametrize(("changes", "message"), [
    ({"params": "Trainable"}, "params must be 'all' or 'trainable'"),
    ({"rho": 0.0}, "rho must be a positive finite number"),
    ({"mode": "best"}, "mode must be 'worst' or 'average'"),
    ({"steps": 0}, "steps must be a positive integer or 'auto'"),
    ({"n_samples": 2.0}, "n_samples must be a positive integer"),
    ({"seed": None}, "seed must be an integer"),
    ({"tol": -1.0}, "tol must be a finite number >= 0"),
    ({"max_steps": True}, "max_steps must be a positive integer"),
    ({"step_normalization": "l2"}, "step_normalization must be 'riemannian', 'euclidean' or 'none'"),
    ({"variant": "as24"}, "variant must be 'clean' or 'as23'"),
    ({"options": SpaceOptions(metric="euclid")}, "metric must be 'inv' or 'mix'"),
    ({"options": SpaceOptions(epsilon=float("nan"))}, "epsilon must be a finite number >= 0"),
])
def test_run_settings_check_themselves(changes, message):
    with pytest.raises(ValueError, match=message):
        RunSettings(**{"rho": defaults.RHO, **changes})


def test_run_settings_hold_plain_python_numbers():
    settings = RunSettings(np.float32(0.5), steps=np.int64(3), n_samples=np.int32(4), seed=np.int64(7),
                           options=SpaceOptions(epsilon=np.float64(0.0)))
    assert (type(settings.rho), type(settings.steps), type(settings.n_samples), type(settings.seed)) == (
        float, int, int, int)
    assert type(settings.options.epsilon) is float and settings.measure == "geodesic_inv_worst"
    assert RunSettings(1.0, steps="auto").steps == "auto"


def test_the_public_signatures_and_the_engine_match_the_one_declaration():
    """``measures.Settings`` declares the shared settings once; the public functions' keywords stay explicit (for
    their signatures and docs) and must carry the same names and defaults, and the engine's ``RunSettings`` too."""
    import dataclasses

    from hf_geosharp.hub.cards import _SETTINGS
    from hf_geosharp.measures import setting_help

    declared = {f.name: f.default for f in dataclasses.fields(Settings)}
    engine = {**_defaults(RunSettings), "epsilon": SpaceOptions().epsilon, "ball": SpaceOptions().ball,
              "variant": defaults.ADAPTIVE_VARIANT}
    for name, default in declared.items():
        geodesic, adaptive = _defaults(gs.geodesic_sharpness), _defaults(gs.adaptive_sharpness)
        if name == "adaptive_variant":
            assert adaptive["variant"] == engine["variant"] == default
            continue
        assert geodesic[name] == default and engine.get(name, default) == default, name  # RunSettings needs rho
        if name not in ("epsilon", "ball"):  # adaptive sharpness has no geodesic metric to relax or calibrate
            assert adaptive[name] == default, name
        assert setting_help(name), name  # every setting says what it means
        assert name in _SETTINGS, name  # and model cards show it
    parser = build_parser()
    run = parser.parse_args(["run", "--model", "m", "--dataset", "d"])
    board = parser.parse_args(["leaderboard", "m", "--dataset", "d"])
    for name in ("rho", "steps", "n_samples", "seed", "epsilon"):
        assert getattr(run, name) == getattr(board, name) == declared[name], name


def test_the_command_lines_share_one_declaration_of_each_option(capsys):
    """``geosharp run`` and ``geosharp leaderboard`` describe each shared option in the same words, the
    declaration's, and parse it the same way."""
    from hf_geosharp.measures import setting_help

    texts = {}
    for command, argv in (("run", ["run", "--help"]), ("leaderboard", ["leaderboard", "--help"])):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        texts[command] = " ".join(capsys.readouterr().out.split())
    for name in ("rho", "steps", "n_samples", "seed", "epsilon"):
        flag, meaning = "--" + name.replace("_", "-"), setting_help(name)
        for command, text in texts.items():
            entry = text.split(f"{flag} {name.upper()} ", 1)[-1].split(" --", 1)[0]  # the option's own help
            assert entry.startswith(meaning) and "(default:" in entry, (command, flag, entry)
    parser = build_parser()
    for command in (["run", "--model", "m", "--dataset", "d"], ["leaderboard", "m", "--dataset", "d"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--steps", "0"])
        assert parser.parse_args([*command, "--steps", "auto"]).steps == "auto"


#: A valid value other than the declared default, for every field of ``Settings``: a new field fails here until the
#: faces below are shown to follow it.
OTHER_VALUES = {"rho": 0.3, "mode": "average", "steps": 20, "n_samples": 3, "seed": 5, "epsilon": 0.0,
                "ball": "paper", "adaptive_variant": "as23", "compile": "default"}


def test_every_setting_has_another_value_to_test_the_faces_with():
    import dataclasses

    assert set(OTHER_VALUES) == {f.name for f in dataclasses.fields(Settings)}
    assert all(getattr(Settings(), name) != value for name, value in OTHER_VALUES.items())


def test_the_evaluate_arguments_follow_the_one_declaration():
    """The evaluate module's argument list is derived from ``Settings``: every field is a keyword of ``compute``
    (default ``None``: the declared default), listed with its declared default and meaning, and reaches the
    settings of the call; the published card lists each one with the same default."""
    import dataclasses

    from hf_geosharp.evaluate_module import measurement
    from hf_geosharp.evaluate_module.register import MODULE_DIR
    from hf_geosharp.measures import setting_help

    text = " ".join(measurement._KWARGS_DESCRIPTION.split())
    card = " ".join((MODULE_DIR / "README.md").read_text().split())
    keywords = inspect.signature(measurement.GeodesicSharpness._compute).parameters
    for field in dataclasses.fields(Settings):
        name, default = field.name, field.default
        assert keywords[name].default is None, name
        entry = text.split(f" {name} (", 1)[1].split(" Returns:", 1)[0]
        assert _shown_default(entry.split("): ", 1)[0].rsplit("default ", 1)[1]) == default, (name, entry[:80])
        assert entry.split("): ", 1)[1].startswith(setting_help(name)), (name, entry[:160])
        assert getattr(measurement.settings_from({name: OTHER_VALUES[name]}), name) == OTHER_VALUES[name]
        on_card = card.split(f"* **{name}** (", 1)[1].split("default `", 1)[1].split("`", 1)[0]
        assert _shown_default(on_card) == default, (name, on_card)


def _shown_default(text: str) -> object:
    """A default as an argument list writes it: ``"worst"``, ``20``, ``1e-06``."""
    if text.startswith('"'):
        return text.strip('"')
    return int(text) if text.isdigit() else float(text)


def test_the_minilm_family_store_key_follows_the_one_declaration():
    """experiments/minilm_family/store.py keys a stored number by the settings' ``as_dict``: changing any declared
    setting changes the key (so a new field of ``Settings`` enters the key without an edit there)."""
    import dataclasses

    from experiments.minilm_family.config import Config
    from experiments.minilm_family.store import measure_key

    config, row = Config(), {"folder": "member", "weights_digest": "0" * 16}
    base = Settings()
    key = measure_key(row, "geodesic_inv", base, "original", config)
    assert key == measure_key(row, "geodesic_inv", Settings(), "original", config)
    for name, value in OTHER_VALUES.items():
        changed = dataclasses.replace(base, **{name: value})
        # A setting that changes no number (``as_dict`` leaves it out, e.g. ``compile``) keeps the key.
        moved = measure_key(row, "geodesic_inv", changed, "original", config) != key
        assert moved == (name in base.as_dict()), name
