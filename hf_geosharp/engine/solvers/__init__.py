"""The solvers over any perturbation space: the clean Auto-PGD with its convergence certificate, the average case,
and AS23's solver kept for comparison with published numbers."""
