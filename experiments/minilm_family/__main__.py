"""``python -m experiments.minilm_family``."""

from .cli import main

main()
