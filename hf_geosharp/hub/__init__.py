"""Publishing to the Hub: model cards and ``.eval_results`` built with huggingface_hub's classes, and pull requests."""
