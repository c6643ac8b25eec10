#!/usr/bin/env bash
# Install hf_geosharp into .compat/KIND and run the compatibility subset there (CI runs both kinds):
#   bash scripts/compat.sh floors   # every dependency at the lower bound pyproject.toml declares (uv lowest-direct)
#   bash scripts/compat.sh newest   # every dependency at its newest release
# "Every dependency" is the core ones and those of the extras (hf_geosharp[space,tensorboard,test]: gradio, pandas,
# tensorboard, peft, gradio_client, playwright, ruff, setuptools, pytest, pytest-timeout), each at the same resolution.
# torch too: floors installs the declared floor (torch>=2.11 -> 2.11.0), newest the newest release on the index. Both
# come from uv, which reads no pip configuration: the pip constraints file some machines carry (/etc/xdg/pip, capping
# torch below the newest release) does not bind it, and nothing under /etc is edited. The index's Linux torch wheels
# are CUDA builds (2.11.0+cu130, 2.15.0+cu132) whose libraries load the CUDA runtime wheels (nvidia-*, about 2.5 GB a
# release) even on a CPU; uv installs them with torch. uv's cache (~/.cache/uv, shared by both jobs and every later
# run) keeps them: only the first run on a machine downloads. The installed versions go to .ci/versions/KIND.txt
# (scripts/supported_versions.py); for floors, a version other than the declared floor fails.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-}"
case "$kind" in
    floors) resolution=lowest-direct ;;
    newest) resolution=highest ;;
    *) echo "usage: bash scripts/compat.sh floors|newest" >&2; exit 2 ;;
esac
# The subset: import and optional imports, the CLI (help and runs), the evaluate module, cards, the Trainer callback,
# the README's example (not its versions block: the newest releases change it), the Space (exported with setuptools,
# installed into a fresh venv, driven through gradio_client and Debian's chromium via playwright), PEFT LoRA, and
# the documentation site's strict build.
TESTS=(
    tests/test_optional_imports.py
    tests/test_readme.py::test_the_python_example_runs_as_written
    tests/test_cli.py
    tests/test_evaluate_module.py
    tests/test_cards.py
    tests/test_integrations.py
    tests/test_gradio_space.py
    tests/test_symmetry_mapping.py::test_lora_pairs_and_trainable_scope
    tests/test_symmetry_report.py::test_healthy_model_has_no_warnings_and_zero_lora_factor_is_flagged
    "tests/test_symmetry_sharpness.py::test_geodesic_sharpness_is_invariant_under_reparametrization[lora-inv]"
)
venv=".compat/$kind"
rm -rf "$venv"
python3 -m venv "$venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# This job's pip (the Space test installs the exported requirements with it) must not apply that cap either: it would
# refuse the torch==2.15.0 the requirements pin. An empty PIP_CONSTRAINT does not lift a configured constraint file.
export PIP_CONSTRAINT=/dev/null
"$venv/bin/pip" install -q uv
"$venv/bin/uv" pip install -q --python "$venv/bin/python" --resolution "$resolution" -e ".[space,tensorboard,test]"
"$venv/bin/python" scripts/supported_versions.py record "$kind"
export HF_HOME="$PWD/$venv/hf_home"
export HF_HUB_OFFLINE=1 HF_EVALUATE_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False
"$venv/bin/geosharp" --help >/dev/null
"$venv/bin/geosharp" register >/dev/null
"$venv/bin/ruff" check .  # the test extra's ruff
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet --site-dir "$venv/site"  # the site, with the extra's mkdocs
