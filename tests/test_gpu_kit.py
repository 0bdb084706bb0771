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
from localserve.models.gguf_meta import model_size, string_metadata

ROOT = Path(__file__).resolve().parent.parent


def llama_src() -> tuple[Path, dict]:
    """scripts/llama-src's folder (gguf-py, the vocabularies), and an environment that runs
    fast_model.py with its gguf-py."""
    version = next(line.split('"')[1] for line in (ROOT / "scripts/setup").read_text().splitlines()
                   if line.startswith("LLAMA_VERSION="))
    src = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "localserve" / \
        f"llama-src-{version}"
    return src, {**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}:{ROOT}"}


@pytest.fixture(scope="module")
def eight_b_shape(tmp_path_factory) -> Path:
    """scripts/make-fast-model fetches gguf-py and the vocabularies once (cached); the 8B
    shape is then written from them with two layers."""
    subprocess.run([str(ROOT / "scripts/make-fast-model")], check=True, stdout=subprocess.DEVNULL,
                   timeout=600)
    src, env = llama_src()
    out = tmp_path_factory.mktemp("gpu") / "llama-8b-shape.gguf"
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


def test_a_qwen_vocabulary_makes_a_llama_with_chatml_and_other_vocabularies_are_refused(
        eight_b_shape, tmp_path):
    """The second fast model of issue 82 (scripts/make-fast-model qwen2 --layers 4 --embd
    512): a Llama whatever the tokenizer, Qwen's 151,936 tokens, a ChatML template; a
    vocabulary of another family (BERT's) is refused by name."""
    src, env = llama_src()

    def write(vocab: str, out: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "localserve.bench.fast_model",
                               str(src / f"models/ggml-vocab-{vocab}.gguf"), str(out),
                               "--embd", "64"], env=env, capture_output=True, text=True,
                              timeout=600)

    made = write("qwen2", tmp_path / "qwen.gguf")
    assert made.returncode == 0, made.stderr
    size = model_size(tmp_path / "qwen.gguf")
    assert (size["n_vocab"], size["n_embd"]) == (151_936, 64)
    meta = string_metadata(tmp_path / "qwen.gguf")
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.chat_template"].startswith("{% for m in messages %}<|im_start|>")
    refused = write("bert-bge", tmp_path / "bert.gguf")
    assert refused.returncode != 0 and "not bert's" in refused.stderr
