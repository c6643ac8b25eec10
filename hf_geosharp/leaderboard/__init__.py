"""Leaderboards: rank many models by sharpness and ask whether sharpness predicts their generalisation gap.

A generalisation measure is judged by how well it ranks models, so the leaderboard measures every model on the same
batches, correlates every measure with the gap (Kendall tau, as in the paper's Section 5, with bootstrap 95 % intervals)
and always puts two trivial predictors beside the sharpness measures, the parameter norm and the clean training loss:
a measure that does not beat them tells the reader little. Whether it beats the parameter norm is read from the
difference of the two taus over the same resampled models (a paired interval).

Long runs must survive being killed, so every number goes into a :class:`~hf_geosharp.leaderboard.store.ResultStore` the
moment it is computed, keyed by a fingerprint of the content of the model and the data
(:mod:`hf_geosharp.leaderboard.store`). A rerun with the same settings skips every finished (model, measure) and only
computes what is missing. Every output file is written durably (:mod:`hf_geosharp.durable`).

The measures and their settings are the registry's (:mod:`hf_geosharp.measures`): a column is a registry measure in a
mode. One job per module: :mod:`.inputs` (models, columns, gap), :mod:`.run` (measuring into the store),
:mod:`.statistics` (Kendall taus, their paired differences, their range over lower bounds) and :mod:`.report`
(Markdown, CSV, plot).
"""

from .inputs import Column, GapMetric, GapSpec, ModelRef, read_gap_file, resolve_models
from .report import markdown, ranked, scatter_plot, table_markdown, taus_markdown, write_csv, write_outputs
from .run import TRIVIAL, Leaderboard, convergence_fix, evaluate_split, run_leaderboard
from .statistics import MIN_MODELS_FOR_CI, kendall_taus, tau_differences, tau_if_raised

__all__ = ["MIN_MODELS_FOR_CI", "TRIVIAL", "Column", "GapMetric", "GapSpec", "Leaderboard", "ModelRef",
           "convergence_fix", "evaluate_split", "kendall_taus", "markdown", "ranked", "read_gap_file",
           "resolve_models", "run_leaderboard", "scatter_plot", "table_markdown", "tau_differences", "tau_if_raised",
           "taus_markdown", "write_csv", "write_outputs"]
