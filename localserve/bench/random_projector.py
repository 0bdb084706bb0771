"""A random-weight vision projector (an "mmproj" GGUF) for a text model of any width: the real
multimodal path (llama.cpp's mtmd: image decoding, resizing, the vision encoder, the
projection into the text model's embeddings) runs in the tests and benchmarks on the embedded
model, with no hub download (issue 70). The answers about an image are noise; the plumbing,
the counts of image tokens and the cost are real.

Its shape is LLaVA 1.5's ("mlp" projector: a CLIP ViT, then two linear layers with GELU
between) made small: a 64-pixel image in 16-pixel patches gives 16 image tokens, decoded
causally like text. Written with gguf-py from llama.cpp's own sources (scripts/make-projector
finds it and runs `python -m localserve.bench.random_projector OUT.gguf --text-embd N`).
"""

from __future__ import annotations

import argparse

import numpy as np

from localserve.bench.fast_model import finish

IMAGE_SIZE, PATCH_SIZE = 64, 16
# CLIP's normalisation, as LLaVA's projector files carry it
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def write(out_path: str, text_embd: int, n_embd: int = 64, n_ff: int = 128, n_layer: int = 2,
          n_head: int = 4, seed: int = 0) -> None:
    import gguf  # llama.cpp's gguf-py, on PYTHONPATH (scripts/make-projector)

    writer = gguf.GGUFWriter(out_path, "clip")
    writer.add_name(f"random mlp projector {n_layer}x{n_embd} -> {text_embd}")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    for key, value in (("embedding_length", n_embd), ("feed_forward_length", n_ff),
                       ("block_count", n_layer), ("projection_dim", text_embd),
                       ("attention.head_count", n_head), ("image_size", IMAGE_SIZE),
                       ("patch_size", PATCH_SIZE)):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", IMAGE_MEAN)
    writer.add_array("clip.vision.image_std", IMAGE_STD)

    rng = np.random.default_rng(seed)
    f32 = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(np.float32)  # noqa: E731
    n_patches = (IMAGE_SIZE // PATCH_SIZE) ** 2
    # the patch convolution's kernel, f16 as llama.cpp's im2col wants it
    writer.add_tensor("v.patch_embd.weight",
                      f32(n_embd, 3, PATCH_SIZE, PATCH_SIZE).astype(np.float16))
    writer.add_tensor("v.position_embd.weight", f32(n_patches, n_embd))
    for i in range(n_layer):
        for norm in ("ln1", "ln2"):
            writer.add_tensor(f"v.blk.{i}.{norm}.weight", np.ones(n_embd, dtype=np.float32))
            writer.add_tensor(f"v.blk.{i}.{norm}.bias", np.zeros(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"v.blk.{i}.{name}.weight", f32(n_embd, n_embd))
            writer.add_tensor(f"v.blk.{i}.{name}.bias", f32(n_embd))
        writer.add_tensor(f"v.blk.{i}.ffn_up.weight", f32(n_ff, n_embd))
        writer.add_tensor(f"v.blk.{i}.ffn_up.bias", f32(n_ff))
        writer.add_tensor(f"v.blk.{i}.ffn_down.weight", f32(n_embd, n_ff))
        writer.add_tensor(f"v.blk.{i}.ffn_down.bias", f32(n_embd))
    writer.add_tensor("mm.0.weight", f32(text_embd, n_embd))
    writer.add_tensor("mm.0.bias", f32(text_embd))
    writer.add_tensor("mm.2.weight", f32(text_embd, text_embd))
    writer.add_tensor("mm.2.bias", f32(text_embd))
    finish(writer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="where to write the projector")
    parser.add_argument("--text-embd", type=int, required=True,
                        help="the text model's embedding width (576 for the embedded model)")
    args = parser.parse_args(argv)
    write(args.out, args.text_embd)


if __name__ == "__main__":
    main()
