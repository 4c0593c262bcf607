"""Trellis: an OpenAI-compatible LLM inference server built around structured generation."""

__version__ = "0.1.0"
