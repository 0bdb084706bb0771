"""Random-weight models of the memory kinds an office runs today (issue 78), written with gguf-py
from llama.cpp's own sources, with a real tokenizer: what the tests and benchmarks serve where a
real hybrid or mixture-of-experts model cannot be had here. Speed and plumbing do not depend on
the weights' values; the cache's kind does.

- `hybrid`: LFM2's shape, short-convolution layers (a recurrent state per sequence: it cannot be
  cut back to a prefix) interleaved with attention layers;
- `hybrid-moe`: LFM2-MoE's, the same memory with mixture-of-experts feed-forward layers after a
  dense lead (experts that `--cpu-moe` places in host memory);
- `hybrid-mamba`: Granite 4's (granitehybrid), Mamba-2 layers (a selective state-space state and
  its convolution, per sequence) interleaved with attention: the recurrent state of Granite 4,
  Nemotron-H and Falcon-H1.

Sliding-window memory is the second real test model's (Gemma 3 270M, scripts/setup-second-model).
scripts/make-memory-model runs `python -m localserve.bench.memory_models KIND VOCAB.gguf OUT.gguf`.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from localserve.bench.fast_model import copy_tokenizer, finish, q4_0_blocks, q4_tensor

KINDS = ("hybrid", "hybrid-moe", "hybrid-mamba")
# ChatML, as LFM2's and Qwen's templates write turns (tokens the Qwen vocabulary has).
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Attention at these layers, short convolutions at the others (LFM2 mixes them so).
ATTENTION_LAYERS = (2, 5)


# Mamba-2's sizes in the Granite 4 writer: llama.cpp takes an expansion of 2 only.
SSM_STATE, SSM_HEADS, SSM_CONV = 16, 8, 4


def write(kind: str, vocab_path: str, out_path: str, n_layer: int = 6, n_embd: int = 128,
          n_ff: int = 256, n_head: int = 4, n_head_kv: int = 2, n_ctx: int = 8192,
          seed: int = 0) -> None:
    import gguf  # llama.cpp's gguf-py, on PYTHONPATH (scripts/make-memory-model)

    arch = {"hybrid": "lfm2", "hybrid-moe": "lfm2moe", "hybrid-mamba": "granitehybrid"}[kind]
    reader = gguf.GGUFReader(vocab_path)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_name(f"random {kind} {n_layer}x{n_embd}, vocab {n_vocab}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_block_count(n_layer)
    writer.add_head_count(n_head)
    writer.add_head_count_kv([n_head_kv if i in ATTENTION_LAYERS else 0 for i in range(n_layer)])
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    if kind == "hybrid-mamba":
        writer.add_ssm_conv_kernel(SSM_CONV)
        writer.add_ssm_inner_size(2 * n_embd)
        writer.add_ssm_state_size(SSM_STATE)
        writer.add_ssm_time_step_rank(SSM_HEADS)
        writer.add_ssm_group_count(1)
    else:
        writer.add_uint32(f"{arch}.shortconv.l_cache", 3)
    moe = kind == "hybrid-moe"
    n_expert, n_dense = 4, 2
    if moe:
        writer.add_leading_dense_block_count(n_dense)
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(n_ff // 2)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    copy_tokenizer(reader, writer, CHATML_TEMPLATE)

    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    q4 = lambda name, rows, cols: q4_tensor(writer, rng, name, rows, cols)  # noqa: E731
    ones = lambda name, *shape: writer.add_tensor(name, np.ones(shape, dtype=np.float32))  # noqa: E731
    small = lambda name, *shape: writer.add_tensor(  # noqa: E731
        name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    q4("token_embd.weight", n_vocab, n_embd)  # also the output layer (tied, as LFM2's)
    ones("output_norm.weight" if kind == "hybrid-mamba" else "token_embd_norm.weight", n_embd)
    for i in range(n_layer):
        ones(f"blk.{i}.attn_norm.weight", n_embd)
        if i in ATTENTION_LAYERS:
            if kind != "hybrid-mamba":  # LFM2 normalizes queries and keys; Granite does not
                ones(f"blk.{i}.attn_q_norm.weight", head_dim)
                ones(f"blk.{i}.attn_k_norm.weight", head_dim)
            q4(f"blk.{i}.attn_q.weight", n_embd, n_embd)
            q4(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
            q4(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
            q4(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        elif kind == "hybrid-mamba":
            d_inner = 2 * n_embd
            conv_dim = d_inner + 2 * SSM_STATE
            q4(f"blk.{i}.ssm_in.weight", 2 * d_inner + 2 * SSM_STATE + SSM_HEADS, n_embd)
            small(f"blk.{i}.ssm_conv1d.weight", conv_dim, SSM_CONV)
            small(f"blk.{i}.ssm_conv1d.bias", conv_dim)
            small(f"blk.{i}.ssm_dt.bias", SSM_HEADS)
            writer.add_tensor(f"blk.{i}.ssm_a", -np.ones((SSM_HEADS, 1), dtype=np.float32))
            ones(f"blk.{i}.ssm_d", SSM_HEADS, 1)
            ones(f"blk.{i}.ssm_norm.weight", 1, d_inner)
            q4(f"blk.{i}.ssm_out.weight", n_embd, d_inner)
        else:
            small(f"blk.{i}.shortconv.conv.weight", n_embd, 3)
            q4(f"blk.{i}.shortconv.in_proj.weight", 3 * n_embd, n_embd)
            q4(f"blk.{i}.shortconv.out_proj.weight", n_embd, n_embd)
        ones(f"blk.{i}.ffn_norm.weight", n_embd)
        if moe and i >= n_dense:
            n_ff_exp = n_ff // 2
            small(f"blk.{i}.ffn_gate_inp.weight", n_expert, n_embd)
            writer.add_tensor(f"blk.{i}.exp_probs_b.bias", np.zeros(n_expert, dtype=np.float32))
            for name, rows, cols in (("gate", n_ff_exp, n_embd), ("up", n_ff_exp, n_embd),
                                     ("down", n_embd, n_ff_exp)):
                experts = np.stack([q4_0_blocks(rng, rows, cols, 0.02) for _ in range(n_expert)])
                writer.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", experts,
                                  raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            q4(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
            q4(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
            q4(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    finish(writer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("vocab", help="a vocabulary-only GGUF with ChatML's special tokens (qwen2)")
    parser.add_argument("out", help="where to write the model")
    args = parser.parse_args(argv)
    write(args.kind, args.vocab, args.out)
    print(args.out, file=sys.stdout)


if __name__ == "__main__":
    main()
