"""The default value of every measurement setting, each written once.

The public functions, the engine's layers and every face (``geosharp`` commands, the evaluate module, the
leaderboard, the Trainer callback, the Space) read their defaults from here, so that changing one changes it
everywhere. It imports nothing of the package: the lowest layers (the geometry, the solvers) can use it without an
import cycle. The convergence defaults (``CONVERGENCE_TOL``, ``AUTO_MAX_STEPS``) live with the solver that defines
them, :mod:`hf_geosharp.engine.solvers.apgd`.
"""

from __future__ import annotations

from typing import Final

#: Radius of the perturbation ball.
RHO: Final = 0.1
#: Worst case (maximise the loss over the ball) rather than the average over random directions.
MODE: Final = "worst"
#: Solver iterations per batch in the worst case: ``"auto"`` runs until two stationary starts agree (certified) or
#: its budget runs out; a number is one start of exactly that many steps, whose value is a lower bound.
STEPS: Final = "auto"
#: The length of a fixed-budget start where a solver is called with a number of steps (AS23's protocol), and of the
#: first block of each start under ``"auto"``.
BLOCK_STEPS: Final = 20
#: Random directions per batch in the average case.
N_SAMPLES: Final = 20
#: Seeds every random draw (per batch, independent of the process that solves it).
SEED: Final = 0
#: Relative, group-covariant relaxation of the geodesic metric's Gram matrices (0: the exact metric).
EPSILON: Final = 1e-6
#: The geodesic metric: the paper's Eq. 9.
METRIC: Final = "inv"
#: The radius convention of the geodesic ball: each attention pair's metric times a group-invariant constant, for inv
#: so that scaling the pair's factors has the norm it has in adaptive sharpness, for mix the smallest that puts its
#: ball inside inv's (``"paper"``: the unweighted metrics of the paper).
BALL: Final = "calibrated"
#: Geodesic for the parameters outside attention pairs: first order, as the paper.
ELEMENTWISE_CURVATURE: Final = "none"
#: The adaptive baseline's solver: the clean Auto-PGD (``"as23"`` reproduces the reference code).
ADAPTIVE_VARIANT: Final = "clean"
#: Step normalisation of the worst-case solver: the invariant one.
STEP_NORMALIZATION: Final = "riemannian"
#: Which parameters are perturbed: all of them, as in AS23.
PARAMS: Final = "all"
#: How a worst-case step runs: eagerly (``"off"``), or captured by ``torch.compile`` (hf_geosharp/engine/capture.py).
COMPILE: Final = "off"
#: Weights smaller than this in magnitude cannot move: the elementwise metric divides by them, so they are frozen
#: (left out of the space) and count as zero.
ZERO_TOL: Final = 1e-12
