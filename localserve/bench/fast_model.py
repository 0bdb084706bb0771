"""A random-weight model whose compute is negligible, with a real model's tokenizer: what a GPU's
fast steps look like to the server, on any CPU (issue 65). Speed and plumbing do not depend on
the weights' values; the vocabulary's size does (every row's sampling and the output layer
walk it), so the tokenizer is a real office model's (Llama 3's 128,256 tokens by default).

Written with gguf-py from llama.cpp's own source tree (llama-cpp-python's source archive ships
it, with vocabulary-only GGUFs under vendor/llama.cpp/models/): scripts/make-fast-model finds
both and runs `python -m localserve.bench.fast_model VOCAB.gguf OUT.gguf`.

Weights are Q4_0 blocks written directly (2 bytes of f16 scale, 16 bytes of nibbles per 32
weights): random nibbles under a small fixed scale keep activations finite after RMS norms.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

# A Llama 3 chat template small enough to read (the model's own has tool-calling blocks that
# neither server needs here); both servers render it from the GGUF.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# ChatML, for a Qwen vocabulary (its <|im_start|> and <|im_end|> are special tokens there).
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The vocabularies a model can be written with, by the architecture their file names: the
# model is a Llama whatever the tokenizer (llama.cpp reads a tokenizer by its own keys).
TEMPLATES = {"llama": LLAMA3_TEMPLATE, "qwen2": CHATML_TEMPLATE}

QK4_0, Q4_0_BYTES = 32, 18


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """rows x cols weights as Q4_0 bytes: (rows, cols / 32 * 18) uint8."""
    blocks = rows * cols // QK4_0
    out = np.empty((blocks, Q4_0_BYTES), dtype=np.uint8)
    out[:, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    out[:, 2:] = rng.integers(0, 256, size=(blocks, 16), dtype=np.uint8)
    return out.reshape(rows, cols // QK4_0 * Q4_0_BYTES)


def copy_tokenizer(reader, writer, template: str) -> None:
    """A vocabulary-only GGUF's tokenizer into the model being written, with `template` as its
    chat template instead of the vocabulary's own."""
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != "tokenizer.chat_template":
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_chat_template(template)


def q4_tensor(writer, rng: np.random.Generator, name: str, rows: int, cols: int,
              scale: float = 0.02) -> None:
    import gguf

    writer.add_tensor(name, q4_0_blocks(rng, rows, cols, scale),
                      raw_dtype=gguf.GGMLQuantizationType.Q4_0)


def finish(writer) -> None:
    """Header, metadata and tensors to the file, which is then closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write(vocab_path: str, out_path: str, n_layer: int = 2, n_embd: int = 256,
          n_ff: int = 512, n_head: int = 4, n_head_kv: int = 2, n_ctx: int = 8192,
          seed: int = 0) -> None:
    import gguf  # llama.cpp's gguf-py, on PYTHONPATH (scripts/make-fast-model)

    reader = gguf.GGUFReader(vocab_path)
    arch = reader.fields["general.architecture"].contents()
    if arch not in TEMPLATES:
        raise SystemExit(f"{vocab_path}: a Llama or Qwen vocabulary is needed, not {arch}'s")
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(out_path, "llama")
    writer.add_name(f"fast random {n_layer}x{n_embd}, vocab {n_vocab}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_block_count(n_layer)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    copy_tokenizer(reader, writer, TEMPLATES[arch])

    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    q4 = lambda name, rows, cols: q4_tensor(writer, rng, name, rows, cols)  # noqa: E731
    ones = lambda name, n: writer.add_tensor(name, np.ones(n, dtype=np.float32))  # noqa: E731
    q4("token_embd.weight", n_vocab, n_embd)  # also the output layer (tied, as Llama 3.2's)
    ones("output_norm.weight", n_embd)
    for i in range(n_layer):
        ones(f"blk.{i}.attn_norm.weight", n_embd)
        q4(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        q4(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        q4(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        q4(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        ones(f"blk.{i}.ffn_norm.weight", n_embd)
        q4(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        q4(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        q4(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    finish(writer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vocab", help="a vocabulary-only GGUF of a Llama or Qwen model")
    parser.add_argument("out", help="where to write the model")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--ff", type=int, help="feed-forward width (default: 2 x --embd)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=8192, help="the trained context it declares")
    parser.add_argument("--shape", choices=["llama-8b"], help="Llama 3.1 8B's shape (32 layers "
                        "of 4096, 14336 feed-forward, 32 heads, 8 KV heads, 131072 context); "
                        "--layers still applies")
    args = parser.parse_args(argv)
    if args.shape == "llama-8b":
        args.embd, args.ff, args.heads, args.kv_heads, args.ctx = 4096, 14336, 32, 8, 131072
        args.layers = args.layers if "--layers" in (argv or sys.argv) else 32
    write(args.vocab, args.out, n_layer=args.layers, n_embd=args.embd,
          n_ff=args.ff or 2 * args.embd, n_head=args.heads, n_head_kv=args.kv_heads, n_ctx=args.ctx)
    print(args.out, file=sys.stdout)


if __name__ == "__main__":
    main()
