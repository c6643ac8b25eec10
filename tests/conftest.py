"""Every test runs offline: no test may touch the Hugging Face Hub."""

import os

for _flag in ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_flag, "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
