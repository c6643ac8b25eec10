"""Deprecated: ``hf_geosharp.hide.transform`` is ``hf_geosharp.hiding.transform``,
renamed so that no module is shadowed by the function ``gs.hide``.
Importing it warns (``DeprecationWarning``) and gives the same objects.
"""

import warnings

from ..hiding.transform import *  # noqa: F403  (the renamed module's public names, the same objects)

warnings.warn("hf_geosharp.hide.transform is deprecated and will be removed: import hf_geosharp.hiding.transform.",
              DeprecationWarning, stacklevel=2)
