"""The ONLY place that calls llama.cpp (llama_cpp's low-level ctypes API); nothing outside
this package imports llama_cpp.

    core.py        LlamaRunner: the generating context, one batch per step, sampling, grammars
    embeddings.py  Embedder: a second context on the same model for /v1/embeddings
    model_file.py  set-up, GGUF facts without loading, memory needs, cache types
"""

from localserve.engine.interfaces import RunnerConfig
from localserve.engine.runner.core import LlamaRunner
from localserve.engine.runner.model_file import CACHE_TYPES, memory_needs, supports_gpu_offload

__all__ = ["CACHE_TYPES", "LlamaRunner", "RunnerConfig", "memory_needs", "supports_gpu_offload"]
