"""Reprise: chat with local language models on MLX."""

__version__ = "0.1.0"
