"""Deprecated: ``hf_geosharp.hide`` is ``hf_geosharp.hiding``,
renamed so that no module is shadowed by the function ``gs.hide``.
Importing it warns (``DeprecationWarning``) and gives the same objects.
"""

import warnings

from ..hiding import *  # noqa: F403  (the renamed module's public names, the same objects)
from ..hiding import __all__  # noqa: F401

warnings.warn("hf_geosharp.hide is deprecated and will be removed: import hf_geosharp.hiding.",
              DeprecationWarning, stacklevel=2)
