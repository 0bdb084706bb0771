"""The ONLY place that calls llama.cpp (llama_cpp's low-level ctypes API); nothing outside
this package imports llama_cpp.

    core.py        LlamaRunner: the generating context, one batch per step
    calls.py       that batch in one llama_decode call or two, and when the pool is compacted
                   (CPU flash attention's tiles)
    batch.py       a call's rows in llama.cpp's token batch, a failed call's rows taken out
    sampling.py    SlotSamplers: each row with its slot's sampler chain, grammars, drafts
    image_steps.py ImagePlacer: a step's image rows, decoded before its text (--mmproj)
    images.py      the projector: an image's rows and their embeddings (mtmd)
    states.py      a sequence's cache state out and back in (the prompt cache)
    embeddings.py  Embedder: a second context on the same model for /v1/embeddings
    model_file.py  set-up, GGUF facts without loading, memory needs, cache types
    rpc.py         llama.cpp's RPC backend: workers, and registering them as devices
    devices.py     the GPUs layers can go to, and their free memory (fitting the model)
    aborts.py      ggml's fatal errors turned into a failed engine instead of a dead process
"""

from localserve.engine.interfaces import RunnerConfig
from localserve.engine.runner.core import LlamaRunner
from localserve.engine.runner.aborts import on_fatal_error
from localserve.engine.runner.model_file import (CACHE_TYPES, load_progress, memory_needs,
                                                 supports_gpu_offload)
from localserve.engine.runner.devices import offload_devices
from localserve.engine.runner.rpc import add_servers, rpc_devices

__all__ = ["CACHE_TYPES", "LlamaRunner", "RunnerConfig", "add_servers", "load_progress", "memory_needs",
           "offload_devices", "on_fatal_error", "rpc_devices", "supports_gpu_offload"]
