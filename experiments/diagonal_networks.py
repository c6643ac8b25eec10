r"""Diagonal-network reproduction of da Silva, Dangel & Oore (ICML 2025), §5.1.1 and Fig. 3.

Fifty diagonal linear nets :math:`f(x) = x^\top(u \odot v)` are fitted by full-batch gradient descent to the same sparse
regression problem (``d = 200`` features, ``n = 100 < d`` training points, a 90 %-sparse ground truth ``beta*``) until
their training loss reaches ``1e-5``. Because ``n < d`` every net interpolates, and *which* interpolator it finds is
decided by the hyperparameters (the init scale ``alpha`` and the learning rate): small ``alpha`` gives the sparse,
well-generalising solution, large ``alpha`` the dense minimum-norm one, and learning rates near the stability edge
move a net away from both. The generalisation measure is the test loss on fresh isotropic Gaussian inputs, which for
noiseless labels is exactly ``||beta - beta*||^2``.

For each net we measure

* worst-case adaptive sharpness (the library's default solver, ``variant="clean"``, through
  :func:`hf_geosharp.adaptive_sharpness` on a two-parameter ``nn.Module``; ``--adaptive-variant as23`` for AS23's
  ``m_apgd_l2``);
* worst-case geodesic sharpness for the inv and mix metrics with the **exact** geodesics of a diagonal net
  (:class:`experiments.exact_geodesic.ExactGeodesicSpace`, solved by the library's
  :func:`hf_geosharp.engine.solvers.apgd.apgd`);

and report Kendall's tau against the test loss with a bootstrap 95 % interval, beside trivial predictors. Three
switches are known to decide the outcome and each is a flag: the mix constraint (``--mix-constraint``), the
initialisation (``--init``) and the adaptive solver's iterations (``--adaptive-steps``). Unless ``--no-sweeps`` is
given, the run also flips each switch, scans rho and repeats the main setting on further data seeds.

Run from the repository root: ``python -m experiments.diagonal_networks`` (results in ``artifacts/diagonal_networks/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import scipy.stats
import torch
from torch import Tensor, nn

import hf_geosharp as gs
from hf_geosharp.commands.common import Parser, folder_path, positive
from hf_geosharp.commands.common import seed as seed_arg
from hf_geosharp.durable import write_json

from .exact_geodesic import DTYPE, Constraint, Metric, geodesic_sharpness

logger = logging.getLogger(__name__)

Init = Literal["reference", "balanced"]
Truth = Literal["signed", "nonnegative"]

AS23_STEPS = 20
PAPER_TAU = {"adaptive": -0.68, "geodesic_inv": -0.83, "geodesic_mix": -0.86}
SHARPNESS_MEASURES = ("adaptive", "geodesic_inv", "geodesic_mix_metric", "geodesic_mix_loose")
GEODESIC_MEASURES: dict[str, tuple[Metric, Constraint]] = {
    "geodesic_inv": ("inv", "metric"),
    "geodesic_mix_metric": ("mix", "metric"),
    "geodesic_mix_loose": ("mix", "loose"),
}
TRIVIAL_PREDICTORS = ("beta_l2", "beta_l1", "train_loss", "alpha")


# ---------------------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Problem:
    """The regression task shared by all nets of a run: ``y = X beta*``, no label noise.

    Attributes:
        X: ``[n, d]`` training inputs, iid standard Gaussian.
        y: ``[n]`` training targets.
        beta_star: ``[d]`` ground truth.
    """

    X: Tensor
    y: Tensor
    beta_star: Tensor

    def train_loss(self, beta: Tensor) -> Tensor:
        """Mean squared error on the training set (batched over the leading dimensions of ``beta``)."""
        return (beta @ self.X.T - self.y).square().mean(-1)

    def test_loss(self, beta: Tensor) -> Tensor:
        """Expected squared error on a fresh ``x ~ N(0, I)``; for noiseless labels this is ``||beta - beta*||^2``."""
        return (beta - self.beta_star).square().sum(-1)


def make_problem(dim: int, n_train: int, nonzeros: int, truth: Truth, seed: int) -> Problem:
    """Gaussian design and a ``nonzeros``-sparse ground truth with N(0, 1) entries (absolute values if nonnegative).

    The same seed gives the same design and support for both truths, so the two can be compared net by net."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n_train, dim, generator=g, dtype=DTYPE)
    support = torch.randperm(dim, generator=g)[:nonzeros]
    values = torch.randn(nonzeros, generator=g, dtype=DTYPE)
    beta_star = torch.zeros(dim, dtype=DTYPE)
    beta_star[support] = values.abs() if truth == "nonnegative" else values
    return Problem(X, X @ beta_star, beta_star)


def sample_hyperparameters(
    n_nets: int, alpha_range: Sequence[float], lr_range: Sequence[float], seed: int
) -> tuple[Tensor, Tensor]:
    """Log-uniform init scales and learning rates, the knobs that give the nets different implicit biases."""
    rng = np.random.default_rng(seed)
    alpha = np.exp(rng.uniform(np.log(alpha_range[0]), np.log(alpha_range[1]), n_nets))
    lr = np.exp(rng.uniform(np.log(lr_range[0]), np.log(lr_range[1]), n_nets))
    return torch.tensor(alpha, dtype=DTYPE), torch.tensor(lr, dtype=DTYPE)


def initial_weights(alpha: Tensor, dim: int, init: Init) -> tuple[Tensor, Tensor]:
    """``reference``: ``u0 = alpha 1, v0 = 0`` (beta starts at 0; the u-odot-v form of the standard symmetric init).
    ``balanced``: ``u0 = v0 = alpha 1``. GD then keeps ``u = v`` exactly, so ``beta = u^2 >= 0`` throughout."""
    u0 = alpha[:, None].expand(-1, dim).clone()
    return u0, (torch.zeros_like(u0) if init == "reference" else u0.clone())


@dataclass
class TrainedNets:
    """Weights and training record of a population of diagonal nets (row ``i`` is net ``i``)."""

    u: Tensor
    v: Tensor
    steps: Tensor
    train_loss: Tensor
    converged: Tensor

    @property
    def beta(self) -> Tensor:
        return self.u * self.v


def train_gd(
    problem: Problem, u0: Tensor, v0: Tensor, lr: Tensor, *, target_loss: float, max_steps: int
) -> TrainedNets:
    """Full-batch gradient descent on all nets at once, each with its own learning rate.

    Each net stops at the first step where its training loss is ``<= target_loss`` (so all end at about the same
    loss, as in the paper); finished nets leave the working batch, which keeps the long tail of slow nets cheap. A net
    that reaches ``max_steps`` or a non-finite loss is kept and flagged ``converged=False``."""
    n_nets, n = u0.shape[0], problem.X.shape[0]
    u, v = u0.clone(), v0.clone()
    steps = torch.full((n_nets,), max_steps, dtype=torch.long)
    final_loss = torch.full((n_nets,), float("nan"), dtype=DTYPE)
    converged = torch.zeros(n_nets, dtype=torch.bool)
    index, ua, va, lra = torch.arange(n_nets), u.clone(), v.clone(), lr.clone()
    Xt = problem.X.T.contiguous()
    for step in range(max_steps + 1):
        residual = (ua * va) @ Xt - problem.y
        loss = residual.square().mean(1)
        reached = loss <= target_loss
        done = reached | ~torch.isfinite(loss) | (step == max_steps)
        if done.any():
            rows = index[done]
            u[rows], v[rows], steps[rows] = ua[done], va[done], step
            final_loss[rows], converged[rows] = loss[done], reached[done]
            keep = ~done
            index, ua, va, lra, residual = index[keep], ua[keep], va[keep], lra[keep], residual[keep]
            if index.numel() == 0:
                break
        grad_beta = (residual @ problem.X) * (2.0 / n) * lra[:, None]
        ua, va = ua - va * grad_beta, va - ua * grad_beta
    return TrainedNets(u, v, steps, final_loss, converged)



class DiagonalNet(nn.Module):
    """``x -> x (u * v)`` as a module, so that the library's adaptive sharpness perturbs ``u`` and ``v``."""

    def __init__(self, u: Tensor, v: Tensor) -> None:
        super().__init__()
        self.u = nn.Parameter(u.detach().clone())
        self.v = nn.Parameter(v.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        return x @ (self.u * self.v)


def _mse(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return (model(batch["x"]) - batch["y"]).square().mean()


def adaptive_sharpness(
    u: Tensor, v: Tensor, problem: Problem, *, rho: float, steps: int, variant: str = "clean"
) -> float:
    """Worst-case adaptive sharpness of one net on the full training batch, via the public API."""
    batch = {"x": problem.X, "y": problem.y}
    with warnings.catch_warnings():  # convergence is reported by the sweep over solver steps, not per net
        warnings.simplefilter("ignore", UserWarning)
        result = gs.adaptive_sharpness(
            DiagonalNet(u, v), [batch], rho=rho, steps=steps, variant=variant, loss_fn=_mse, progress=False
        )
    return result.value


# ------------------------------------------------------------------------------------------------ statistics
def bootstrap_kendall(x: np.ndarray, y: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Kendall's tau-b of every bootstrap resample at once, given each resample's multiplicity vector ``c``.

    With ``S_x[i, j] = sign(x_i - x_j)`` (likewise ``S_y``), a resample's pairs are the pairs of its draws, so its
    tau-b is ``c^T (S_x * S_y) c / sqrt(c^T |S_x| c * c^T |S_y| c)``: repeated draws of one model form tied pairs and
    drop out of numerator and denominator exactly as in ``scipy.stats.kendalltau``. This costs one ``[B, n] x [n, n]``
    product instead of ``B`` calls (which dominated the run time)."""
    sx, sy = np.sign(x[:, None] - x[None, :]), np.sign(y[:, None] - y[None, :])

    def quad(m: np.ndarray) -> np.ndarray:
        return np.einsum("bi,ij,bj->b", counts, m, counts)

    with np.errstate(invalid="ignore", divide="ignore"):
        return quad(sx * sy) / np.sqrt(quad(np.abs(sx)) * quad(np.abs(sy)))


def kendall(x: np.ndarray, y: np.ndarray, *, n_boot: int, seed: int) -> dict[str, Any]:
    """Kendall's tau (``scipy.stats.kendalltau``: tau-b, the paper's tau-a when there are no ties) with a percentile
    bootstrap 95 % interval over resampled models."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    result = scipy.stats.kendalltau(x, y)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(len(x), np.full(len(x), 1.0 / len(x)), size=n_boot).astype(float)
    lo, hi = np.nanpercentile(bootstrap_kendall(x, y, counts), [2.5, 97.5])
    return {"tau": float(result.statistic), "ci95": [float(lo), float(hi)], "p_value": float(result.pvalue)}


# ------------------------------------------------------------------------------------------------ experiment
@dataclass(frozen=True)
class Setting:
    """Everything that determines one population of nets and its sharpness values."""

    init: Init = "reference"
    truth: Truth = "signed"
    data_seed: int = 0
    rho: float = 0.1
    adaptive_steps: int = AS23_STEPS
    geodesic_steps: int = AS23_STEPS


class Experiment:
    """Trains populations of nets and measures them, caching both, so that sweeps only pay for what changes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.alpha, self.lr = sample_hyperparameters(args.n_nets, args.alpha_range, args.lr_range, args.seed)
        self._nets: dict[tuple, tuple[Problem, TrainedNets]] = {}
        self._values: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def nets(self, setting: Setting) -> tuple[Problem, TrainedNets]:
        key = (setting.init, setting.truth, setting.data_seed)
        if key not in self._nets:
            a = self.args
            start = time.perf_counter()
            problem = make_problem(a.dim, a.n_train, a.nonzeros, setting.truth, setting.data_seed)
            u0, v0 = initial_weights(self.alpha, a.dim, setting.init)
            nets = train_gd(problem, u0, v0, self.lr, target_loss=a.target_loss, max_steps=a.max_steps)
            logger.info(
                "trained %d nets (init=%s, truth=%s, data seed %d) in %.1f s: %d converged, max %d steps",
                a.n_nets, *key, time.perf_counter() - start, int(nets.converged.sum()), int(nets.steps.max()),
            )
            self._nets[key] = (problem, nets)
        return self._nets[key]

    def sharpness(self, setting: Setting, measure: str) -> tuple[np.ndarray, np.ndarray]:
        """One measure for every net that reached the target loss (NaN for the others), and the number of coordinates
        whose geodesic was cut at ``beta_i = 0`` at the worst point (only the mix geodesic can be cut; else 0)."""
        steps = setting.adaptive_steps if measure == "adaptive" else setting.geodesic_steps
        key = (setting.init, setting.truth, setting.data_seed, measure, setting.rho, steps)
        if key not in self._values:
            problem, nets = self.nets(setting)
            start = time.perf_counter()
            values, cut = np.full(len(nets.u), np.nan), np.zeros(len(nets.u), dtype=int)
            for i in np.flatnonzero(nets.converged.numpy()):
                if measure == "adaptive":
                    values[i] = adaptive_sharpness(nets.u[i], nets.v[i], problem, rho=setting.rho, steps=steps,
                                                   variant=self.args.adaptive_variant)
                else:
                    metric, constraint = GEODESIC_MEASURES[measure]
                    values[i], cut[i] = geodesic_sharpness(
                        nets.u[i], nets.v[i], problem,
                        metric=metric, constraint=constraint, rho=setting.rho, steps=steps,
                    )
            logger.info(
                "%s (rho=%g, %d steps, %s): %.1f s", measure, setting.rho, steps, key[:3], time.perf_counter() - start
            )
            self._values[key] = (values, cut)
        return self._values[key]

    def evaluate(self, setting: Setting, *, with_models: bool = False) -> dict[str, Any]:
        """Kendall tau against the test loss of every sharpness measure and trivial predictor, over the nets that
        reached the target loss (the paper's population: all trained to 1e-5)."""
        problem, nets = self.nets(setting)
        ok = nets.converged.numpy()
        test_loss = problem.test_loss(nets.beta).numpy()
        columns: dict[str, np.ndarray] = {m: self.sharpness(setting, m)[0] for m in SHARPNESS_MEASURES}
        columns.update(
            beta_l2=nets.beta.norm(dim=1).numpy(),
            beta_l1=nets.beta.abs().sum(1).numpy(),
            train_loss=nets.train_loss.numpy(),
            alpha=self.alpha.numpy(),
        )
        cut = {c: self.sharpness(setting, f"geodesic_mix_{c}")[1] for c in ("metric", "loose")}
        gram = problem.X.T @ problem.X / problem.X.shape[0]
        boot = dict(n_boot=self.args.bootstrap, seed=self.args.seed)
        out: dict[str, Any] = {
            "setting": dataclasses.asdict(setting),
            "tau": {name: kendall(col[ok], test_loss[ok], **boot) for name, col in columns.items()},
            "n_converged": int(ok.sum()),
            "test_loss_range": [float(test_loss[ok].min()), float(test_loss[ok].max())],
            "mix_cut_coordinates_median": {c: float(np.median(v[ok])) for c, v in cut.items()},
            "sharpness_range": {
                m: [float(columns[m][ok].min()), float(columns[m][ok].max())] for m in SHARPNESS_MEASURES
            },
            # The metric-ball mix sharpness every interpolating net would have if its geodesics could cross beta_i = 0:
            # max over ||delta|| <= sqrt(2) rho of delta^T (X^T X / n) delta.
            "mix_metric_uncut_value": 2 * setting.rho**2 * float(torch.linalg.eigvalsh(gram).max()),
        }
        if with_models:
            models = {
                "alpha": self.alpha.numpy(), "lr": self.lr.numpy(), "steps": nets.steps.numpy(), "converged": ok,
                "test_loss": test_loss, **columns, **{f"mix_cut_{c}": v for c, v in cut.items()},
            }
            out["models"] = [{k: _plain(np.asarray(v)[i]) for k, v in models.items()} for i in range(len(test_loss))]
            out["columns"] = {name: col[ok] for name, col in {"test_loss": test_loss, **columns}.items()}
        return out


def _plain(x: np.generic) -> Any:
    """A JSON-ready scalar: non-finite floats (nets that never reached the target loss) become ``None``."""
    value = x.item()
    return None if isinstance(value, float) and not np.isfinite(value) else value


def _other_steps(steps: int, converged: int) -> int:
    return converged if steps != converged else AS23_STEPS


def solver_convergence(experiment: Experiment, main: Setting) -> dict[str, dict[str, Any]]:
    """Per measure, how far the main setting's solver is from a run with the other iteration count: an
    under-converged solver can shift or reorder values and so fake (or hide) a difference in tau."""
    conv = experiment.args.converged_steps
    ok = experiment.nets(main)[1].converged.numpy()
    out = {}
    for measure in SHARPNESS_MEASURES:
        field = "adaptive_steps" if measure == "adaptive" else "geodesic_steps"
        other = dataclasses.replace(main, **{field: _other_steps(getattr(main, field), conv)})
        a, b = experiment.sharpness(main, measure)[0][ok], experiment.sharpness(other, measure)[0][ok]
        ratio = a / b
        out[measure] = {
            "steps": [getattr(main, field), getattr(other, field)],
            "ratio_min": float(ratio.min()),
            "ratio_median": float(np.median(ratio)),
            "ratio_max": float(ratio.max()),
            "tau_between": float(scipy.stats.kendalltau(a, b).statistic),
        }
    return out


def sweeps(experiment: Experiment, main: Setting) -> dict[str, Any]:
    """Flip each switch once (the mix constraint is a column of every row), then scan rho and the data seed."""
    conv = experiment.args.converged_steps
    other_init: Init = "balanced" if main.init == "reference" else "reference"
    other_truth: Truth = "nonnegative" if main.truth == "signed" else "signed"
    adaptive_steps = _other_steps(main.adaptive_steps, conv)
    geodesic_steps = _other_steps(main.geodesic_steps, conv)
    replace = dataclasses.replace
    rows: dict[str, list[tuple[str, Setting]]] = {
        "switches": [
            ("main", main),
            (f"adaptive {adaptive_steps} steps", replace(main, adaptive_steps=adaptive_steps)),
            (f"geodesic {geodesic_steps} steps", replace(main, geodesic_steps=geodesic_steps)),
            (f"init {other_init}", replace(main, init=other_init)),
            (f"truth {other_truth}", replace(main, truth=other_truth)),
            (f"init {other_init}, truth {other_truth}", replace(main, init=other_init, truth=other_truth)),
        ],
        "rho": [(f"rho {rho:g}", replace(main, rho=rho)) for rho in experiment.args.rho_grid],
        "data_seed": [
            (f"data seed {seed}", replace(main, data_seed=seed))
            for seed in dict.fromkeys([main.data_seed, *experiment.args.data_seeds])
        ],
    }
    out: dict[str, Any] = {
        group: [{"label": label, **experiment.evaluate(setting)} for label, setting in settings]
        for group, settings in rows.items()
    }
    out["solver_convergence"] = solver_convergence(experiment, main)
    return out


# ------------------------------------------------------------------------------------------------ reporting
PANELS = (("adaptive", "adaptive"), ("geodesic_inv", "geodesic inv"), ("geodesic_mix", "geodesic mix"))


def plot_figure(
    columns: dict[str, np.ndarray], tau: dict[str, dict], setting: Setting, mix_constraint: str,
    path: Path | None = None,
) -> Any:
    """Fig. 3 of the paper: one panel per measure, sharpness against test loss, tau in the title; colour = alpha. In
    the shared style of :mod:`hf_geosharp.plots`; written to ``path`` when one is given.

    Args:
        columns: per converged net, ``test_loss``, ``alpha`` and each sharpness measure.
        tau: each column's Kendall tau against the test loss, with ``ci95``.
        setting: the population's setting (title and radius).
        mix_constraint: which mix ball the third panel shows (``"metric"`` or ``"loose"``).
        path: where the PNG goes, or None.

    Returns:
        The matplotlib ``Figure``.
    """
    from matplotlib.ticker import MaxNLocator

    from hf_geosharp.plots import LABEL, TICK, TITLE, new_figure, save_figure

    fig = new_figure(3.9)
    axes = fig.subplots(1, 3, sharey=True)
    colour = np.log10(columns["alpha"])
    for ax, (name, title) in zip(axes, PANELS):
        key = f"geodesic_mix_{mix_constraint}" if name == "geodesic_mix" else name
        steps = setting.adaptive_steps if name == "adaptive" else setting.geodesic_steps
        t = tau[key]
        points = ax.scatter(columns[key], columns["test_loss"], c=colour, cmap="viridis", s=14, edgecolors="none")
        ax.set_title(
            f"{title}" + (f", {mix_constraint} ball" if name == "geodesic_mix" else "") + f", {steps} it.\n"
            f"$\\tau$ = {t['tau']:.2f} [{t['ci95'][0]:.2f}, {t['ci95'][1]:.2f}]\n(paper {PAPER_TAU[name]:.2f})",
            fontsize=LABEL,
        )
        ax.set_xlabel(f"worst-case sharpness ($\\rho$ = {setting.rho:g})", fontsize=TICK)
        ax.tick_params(labelsize=TICK)
        ax.xaxis.set_major_locator(MaxNLocator(4))  # few ticks: legible at the README's width
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test loss $\\|\\beta - \\beta^*\\|^2$", fontsize=LABEL)
    bar = fig.colorbar(points, ax=axes, fraction=0.04, pad=0.02)
    bar.set_label(r"$\log_{10}$ init scale $\alpha$", fontsize=TICK)
    bar.ax.tick_params(labelsize=TICK)
    fig.suptitle(f"Diagonal linear nets (init {setting.init}, truth {setting.truth}, data seed {setting.data_seed})",
                 fontsize=TITLE)
    fig.set_layout_engine("constrained")
    if path is not None:
        save_figure(fig, path)
    return fig


def replot(report: dict[str, Any], path: Path | None = None) -> Any:
    """The figure drawn again from a saved report (``diagonal_networks.json``): the converged nets' values, taus and
    setting as measured, nothing measured again.

    Args:
        report: the report :func:`run` wrote.
        path: where the PNG goes, or None.

    Returns:
        The matplotlib ``Figure``.
    """
    main = report["main"]
    nets = [m for m in main["models"] if m["converged"]]
    names = ("test_loss", "alpha", *SHARPNESS_MEASURES)
    columns = {name: np.array([float(m[name]) for m in nets]) for name in names}
    return plot_figure(columns, main["tau"], Setting(**main["setting"]), report["config"]["mix_constraint"], path)


def format_table(main: dict[str, Any], sweep: dict[str, Any] | None) -> str:
    """Plain-text summary printed at the end of a run."""

    def cell(t: dict[str, Any]) -> str:
        return f"{t['tau']:+.2f} [{t['ci95'][0]:+.2f},{t['ci95'][1]:+.2f}]"

    names = list(SHARPNESS_MEASURES) + ["beta_l1"]
    header = f"{'setting':38s}" + "".join(f"{n:>22s}" for n in names)
    rows = [header]
    if sweep is None:
        rows.append(f"{'main':38s}" + "".join(f"{cell(main['tau'][n]):>22s}" for n in names))
    for group in ("switches", "rho", "data_seed") if sweep else ():
        for row in sweep[group]:
            rows.append(f"{row['label'][:38]:38s}" + "".join(f"{cell(row['tau'][n]):>22s}" for n in names))
    rows.append("paper: adaptive -0.68, geodesic inv -0.83, geodesic mix -0.86")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m experiments.diagonal_networks",
        description="Diagonal-network reproduction (paper §5.1.1, Fig. 3): sharpness vs test loss, Kendall tau.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=folder_path, default=Path("artifacts/diagonal_networks"), help="output folder")
    p.add_argument("--n-nets", type=positive(int), default=50)
    p.add_argument("--dim", type=positive(int), default=200, help="number of features d")
    p.add_argument("--n-train", type=positive(int), default=100, help="training points n (< d: every net interpolates)")
    p.add_argument("--nonzeros", type=positive(int), default=20, help="non-zeros of beta* (20 of 200: 90%% sparse)")
    p.add_argument("--truth", choices=("signed", "nonnegative"), default="signed", help="sign of beta*'s non-zeros")
    p.add_argument("--init", choices=("reference", "balanced"), default="reference",
                   help="reference: u0 = alpha, v0 = 0; balanced: u0 = v0 = alpha (forces beta >= 0)")
    p.add_argument("--alpha-range", type=positive(float), nargs=2, default=(0.01, 1.0), help="log-uniform init scales")
    p.add_argument("--lr-range", type=positive(float), nargs=2, default=(0.01, 0.25), help="log-uniform learning rates")
    p.add_argument("--target-loss", type=positive(float), default=1e-5, help="GD stops at this training MSE")
    p.add_argument("--max-steps", type=positive(int), default=200_000,
                   help="GD step cap (nets that hit it are flagged)")
    p.add_argument("--rho", type=positive(float), default=0.1, help="radius of every sharpness ball")
    p.add_argument("--mix-constraint", choices=("metric", "loose"), default="metric",
                   help="mix ball shown in the figure: metric sqrt(2)||b*beta0|| <= rho or loose ||b|| <= rho")
    p.add_argument("--adaptive-steps", type=positive(int), default=AS23_STEPS,
                   help="adaptive solver iterations (AS23 uses 20)")
    p.add_argument("--adaptive-variant", choices=("clean", "as23"), default="clean",
                   help="adaptive solver: the library's default 'clean' (reaches the maximum) or AS23's 'as23'")
    p.add_argument("--geodesic-steps", type=positive(int), default=AS23_STEPS,
                   help="geodesic APGD iterations")
    p.add_argument("--converged-steps", type=positive(int), default=200,
                   help="iterations of the 'converged' sweep rows")
    p.add_argument("--bootstrap", type=positive(int), default=2000, help="bootstrap resamples for the tau intervals")
    p.add_argument("--data-seed", type=seed_arg, default=0, help="seed of X and beta*")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the hyperparameters and of the bootstrap")
    p.add_argument("--no-sweeps", action="store_true", help="only the main setting (no switch/rho/seed tables)")
    p.add_argument("--rho-grid", type=positive(float), nargs="*", default=(0.01, 0.03, 0.3, 1.0), help="rho sweep")
    p.add_argument("--data-seeds", type=seed_arg, nargs="*", default=(1, 2, 3, 4), help="further data seeds")
    p.add_argument("--threads", type=positive(int), default=1,
                   help="torch threads (the problems are tiny; more threads mostly add contention)")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="only draw diagonal_networks.png into --out again from a saved diagonal_networks.json")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The arguments, with what relates two of them checked before any work (usage errors: one line, exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.nonzeros > args.dim:
        parser.error(f"--nonzeros {args.nonzeros} exceeds --dim {args.dim}")
    for name in ("alpha_range", "lr_range"):
        low, high = getattr(args, name)
        if low > high:
            parser.error(f"--{name.replace('_', '-')} {low} {high}: give the low end first")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train, measure, write ``diagonal_networks.{json,png}`` into ``args.out`` and return the report."""
    start, cpu_start = time.perf_counter(), time.process_time()
    experiment = Experiment(args)
    setting = Setting(args.init, args.truth, args.data_seed, args.rho, args.adaptive_steps, args.geodesic_steps)
    main_result = experiment.evaluate(setting, with_models=True)
    columns = main_result.pop("columns")
    sweep = None if args.no_sweeps else sweeps(experiment, setting)
    runtime, cpu = time.perf_counter() - start, time.process_time() - cpu_start

    args.out.mkdir(parents=True, exist_ok=True)
    plot_figure(columns, main_result["tau"], setting, args.mix_constraint, args.out / "diagonal_networks.png")
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "paper_tau": PAPER_TAU,
        "figure_measures": {"adaptive": "adaptive", "geodesic_inv": "geodesic_inv",
                            "geodesic_mix": f"geodesic_mix_{args.mix_constraint}"},
        "main": main_result,
        "sweeps": sweep,
        "runtime_s": runtime,
        "cpu_s": cpu,
        "environment": {"torch": torch.__version__, "hf_geosharp": gs.__version__, "threads": torch.get_num_threads(),
                        "python": platform.python_version(), "machine": platform.machine()},
    }
    write_json(args.out / "diagonal_networks.json", report, indent=1)
    logger.info("wrote %s/diagonal_networks.{json,png}: %.0f s wall, %.0f s CPU", args.out, runtime, cpu)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry: configure logging and threads (process-wide), run, print the tau table."""
    args = parse_args(argv)
    if args.replot is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        replot(json.loads(args.replot.read_text()), args.out / "diagonal_networks.png")
        print(f"wrote {args.out / 'diagonal_networks.png'}")
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hf_geosharp").setLevel(logging.WARNING)  # one INFO line per adaptive call is noise here
    torch.set_num_threads(args.threads)
    report = run(args)
    print(format_table(report["main"], report["sweeps"]))


if __name__ == "__main__":
    main()
