"""Checkpoint files (GGUF, Hugging Face folders) -> HF-named numpy tensors and a config dict."""
