"""Deprecated: ``hf_geosharp.hide.seek`` is ``hf_geosharp.hiding.seek``,
renamed so that no module is shadowed by the function ``gs.hide``.
Importing it warns (``DeprecationWarning``) and gives the same objects.
"""

import warnings

from ..hiding.seek import *  # noqa: F403  (the renamed module's public names, the same objects)

warnings.warn("hf_geosharp.hide.seek is deprecated and will be removed: import hf_geosharp.hiding.seek.",
              DeprecationWarning, stacklevel=2)
