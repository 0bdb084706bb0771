"""What the GPU run (scripts/bench-gpu) builds on, tried here: Llama 3.1 8B's shape written as
a random-weight file (2 of its 32 layers) with Llama 3's tokenizer, read back by the fit's
GGUF reader and by llama.cpp alike, and fitted to a fake card; the script's own guard rails.
The whole dry run (`scripts/bench-gpu --dry-run`, about 3 minutes and a llama-server build)
is run by hand; see docs/performance.md."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from localserve.engine.runner import memory_needs
from localserve.models.fit import Device, ModelSize, fit
from localserve.models.gguf_meta import model_size

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def eight_b_shape(tmp_path_factory) -> Path:
    """scripts/make-fast-model fetches gguf-py and the vocabularies once (cached); the 8B
    shape is then written from them with two layers."""
    subprocess.run([str(ROOT / "scripts/make-fast-model")], check=True, stdout=subprocess.DEVNULL,
                   timeout=600)
    version = next(line.split('"')[1] for line in (ROOT / "scripts/setup").read_text().splitlines()
                   if line.startswith("LLAMA_VERSION="))
    src = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "localserve" / \
        f"llama-src-{version}"
    out = tmp_path_factory.mktemp("gpu") / "llama-8b-shape.gguf"
    env = {**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}:{ROOT}"}
    subprocess.run([sys.executable, "-m", "localserve.bench.fast_model",
                    str(src / "models/ggml-vocab-llama-bpe.gguf"), str(out), "--shape", "llama-8b",
                    "--layers", "2"], check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
    return out


def test_the_8b_shape_is_read_alike_by_the_fit_and_by_llama_cpp(eight_b_shape):
    size = model_size(eight_b_shape)
    needs = memory_needs(str(eight_b_shape))
    assert (size["n_embd"], size["n_vocab"], len(size["layers"])) == (4096, 128_256, 2)
    per_layer = (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096) * 18 // 32  # Q4_0
    assert size["layers"][0] == size["layers"][1] == pytest.approx(per_layer + 2 * 4096 * 4, rel=0.01)
    assert size["output"] == size["embeddings"] + 4096 * 4  # tied, and the output norm
    assert needs["n_ctx_train"] == 131_072 and needs["kv_bytes_per_token"] == 2 * 8 * 128 * 2 * 2
    shape = ModelSize(tuple(size["layers"]), size["output"], size["embeddings"],
                      needs["kv_bytes_per_token"], needs["n_ctx_train"], size["n_vocab"], size["n_embd"])
    chosen = fit(shape, [Device("CUDA0", 4 * 1024 ** 3)])
    assert chosen.n_gpu_layers == 3 and chosen.ctx_size == 131_072


def test_the_gpu_script_parses_and_refuses_what_it_does_not_know():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/bench-gpu")]).returncode == 0
    refused = subprocess.run([str(ROOT / "scripts/bench-gpu"), "--bogus"], capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "usage: scripts/bench-gpu" in refused.stderr
