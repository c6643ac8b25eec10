"""Every test runs offline: no test may touch the Hugging Face Hub."""

import os
import signal

import pytest

for _flag in ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_flag, "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


@pytest.fixture(scope="module")
def measurement():
    """The evaluate module, loaded by path (one instance per test module)."""
    import evaluate

    import hf_geosharp as gs

    return evaluate.load(gs.EVALUATE_MODULE_SCRIPT, keep_in_memory=True)


@pytest.fixture
def ctrl_c_raises():
    """A real SIGINT raises KeyboardInterrupt in the test, and in the processes it starts, as in a terminal, whatever
    the run inherited: a shell without job control starts background jobs with SIGINT ignored, Python then leaves it
    ignored, and child processes inherit that."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
