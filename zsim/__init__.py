"""Simulate DeepSpeed ZeRO training steps. The import layers are declared once, in pyproject.toml
[tool.importlinter], and checked by tests/house/test_layers.py."""
