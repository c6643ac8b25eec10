"""One measuring pipeline under every face: a typed :class:`Request` in, results out.

``geosharp run``, the evaluate module, the Trainer callback, the leaderboard, the Hub Space app and the experiments
parse their inputs into a :class:`Request`; :func:`prepare` maps the symmetries, shards under FSDP2 and shares the
batches across ranks, :meth:`Prepared.measure` runs the registry's measures. :class:`Memo` keeps computed records in
a result store; :mod:`.launch` is how the processes of a launch run together.
"""

from ..engine.placement.sharding import init_distributed, is_sharded
from .measuring import ModelSource, OnResult, Prepared, Request, gathered_rows, load, measure, prepare, symmetry_map
from .memo import Memo

__all__ = ["Memo", "ModelSource", "OnResult", "Prepared", "Request", "gathered_rows", "init_distributed", "is_sharded",
           "load", "measure", "prepare", "symmetry_map"]
