"""hf_geosharp: geodesic sharpness (da Silva, Dangel, Oore, ICML 2025) for Hugging Face models."""

__version__ = "0.1.0"
