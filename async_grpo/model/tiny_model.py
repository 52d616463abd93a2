"""The old path of demo_assets/tiny_model.py, kept while tests/launch and tests/algo import it."""

from async_grpo.demo_assets.tiny_model import TinyModelConfig, write_tiny_model  # noqa: F401
