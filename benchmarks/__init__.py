"""Benchmarks of hf_geosharp: overhead against adaptive sharpness, the forward/backward floor, memory, scaling, peer.

Run ``python -m benchmarks [--suite overhead,floor,memory,scaling,peer] [--quick] [--device cpu|cuda]``. Each suite
writes ``benchmarks/results/<suite>-<device>.json`` and prints a markdown table; ``docs/benchmarks.md`` discusses the
numbers. ``python -m benchmarks.cuda_agreement`` checks that a GPU gives the CPU's numbers. These are scripts, never
timed tests: timings depend on the machine and its load.
"""
