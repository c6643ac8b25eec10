#!/usr/bin/env bash
# Install hf_geosharp into .compat/KIND and run the compatibility subset there (CI runs both kinds):
#   bash scripts/compat.sh floors   # every dependency at the lower bound pyproject.toml declares (uv lowest-direct)
#   bash scripts/compat.sh newest   # every dependency at its newest release
# torch is the 2.13.0 CPU wheel in both (otherwise a resolver pulls a multi-GB CUDA build). The installed versions go
# to .ci/versions/KIND.txt (scripts/supported_versions.py); for floors, a version other than the declared floor fails.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-}"
case "$kind" in
    floors) resolution=lowest-direct ;;
    newest) resolution=highest ;;
    *) echo "usage: bash scripts/compat.sh floors|newest" >&2; exit 2 ;;
esac
# The subset: import and optional imports, the CLI (help and runs), the evaluate module, cards, the Trainer callback
# and the README's example (not its versions block: the newest releases change it).
TESTS=(
    tests/test_optional_imports.py
    tests/test_readme.py::test_the_python_example_runs_as_written
    tests/test_cli.py
    tests/test_evaluate_module.py
    tests/test_cards.py
    tests/test_integrations.py
)
venv=".compat/$kind"
rm -rf "$venv"
python3 -m venv "$venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch without its dependencies: uv resolves those with the rest, at the same resolution.
"$venv/bin/pip" install -q --no-deps torch==2.13.0
"$venv/bin/pip" install -q uv
echo "torch==2.13.0" > "$venv/torch.txt"
"$venv/bin/uv" pip install -q --python "$venv/bin/python" --resolution "$resolution" --override "$venv/torch.txt" \
    -e . "pytest>=8" "pytest-timeout>=2.3"
"$venv/bin/python" scripts/supported_versions.py record "$kind"
export HF_HOME="$PWD/$venv/hf_home"
"$venv/bin/geosharp" --help >/dev/null
"$venv/bin/geosharp" register >/dev/null
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
