"""localserve: a local LLM server with continuous batching over llama.cpp slots."""

__version__ = "0.1.0"
