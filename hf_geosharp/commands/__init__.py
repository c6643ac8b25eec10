"""Sub-commands of the ``geosharp`` CLI; see :mod:`hf_geosharp.cli`."""
