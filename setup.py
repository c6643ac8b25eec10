"""Packaging beside pyproject.toml (which holds everything else): the published evaluate module ships in the package.

The evaluate module (loading script and measurement card) lives at the top of the repository as ``metric_card/``, the
folder as it is published; ``hf_geosharp.evaluate_module.register`` finds it as ``hf_geosharp/metric_card/`` in an
installed wheel. pyproject.toml cannot map a folder outside the package into it while discovering the sub-packages,
hence this file.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["hf_geosharp*"]), "hf_geosharp.metric_card"],
    package_dir={"hf_geosharp.metric_card": "metric_card"},
)
