"""``python -m hf_geosharp`` (also what ``accelerate launch -m hf_geosharp`` runs)."""

import sys

from .cli import main

sys.exit(main())
