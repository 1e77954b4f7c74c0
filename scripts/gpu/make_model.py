#!/usr/bin/env python3
"""A verifier model of a real size with random weights, for a machine that model weights
cannot reach: a llama-architecture GGUF at Q8_0 of a named shape, with the tokenizer of a
vocabulary-only GGUF (`GET /vocab`'s file, or any GGUF: only its `tokenizer.*` keys are
read).

Random weights give the same kernels and the same cost per row as trained ones of the
shape; their text is noise, and their logits are closer together than a trained model's,
which makes an exactness check harder, not easier. What drafts are accepted is set by the
load test's replayed drafters, not by the model.

    .venv/bin/python scripts/gpu/make_model.py --vocab models/x.vocab.gguf --shape llama-1b \\
        --out build/gpu/llama-1b-random-q8_0.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

Q8_BLOCK = 32  # weights a Q8_0 block holds: an f16 scale, then 32 int8


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    rope_base: float = 500000.0


# Named for the published models whose dimensions they copy (the vocabulary is the given
# GGUF's, so the embedding differs); `tiny` is for rehearsals on a CPU and for the tests.
SHAPES = {
    "tiny": Shape(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512),
    "llama-1b": Shape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192),
    "qwen-1.5b": Shape(n_embd=1536, n_layer=28, n_head=12, n_head_kv=2, n_ff=8960),
    "llama-8b": Shape(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336),
}


def q8_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks for a (rows, cols) matrix, written directly (quantizing a float
    matrix of an 8B model would take minutes): scales so that a row's weights have the
    spread 1/sqrt(cols) of a usual initialisation."""
    if cols % Q8_BLOCK:
        raise ValueError(f"{cols} columns is not a multiple of {Q8_BLOCK}")
    blocks = np.empty((rows, cols // Q8_BLOCK, 2 + Q8_BLOCK), dtype=np.uint8)
    scale = np.float16(1.0 / (np.sqrt(cols) * 73.9))  # 73.9: the spread of uniform int8
    blocks[:, :, :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = rng.integers(0, 256, size=(rows, cols // Q8_BLOCK, Q8_BLOCK), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def copy_tokenizer(reader: GGUFReader, writer: GGUFWriter) -> int:
    """The vocabulary GGUF's `tokenizer.*` keys; returns its vocabulary size."""
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(field.data)
    if not n_vocab:
        raise SystemExit("the vocabulary GGUF has no tokenizer.ggml.tokens")
    return n_vocab


def write_model(vocab: Path, shape_name: str, out: Path, seed: int = 0) -> Path:
    shape = SHAPES[shape_name]
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out), "llama")
    writer.add_name(f"random {shape_name} (llama architecture, random Q8_0 weights)")
    writer.add_file_type(7)  # MOSTLY_Q8_0
    n_vocab = copy_tokenizer(GGUFReader(str(vocab)), writer)
    head_dim = shape.n_embd // shape.n_head
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)

    def matrix(name: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, q8_0(rows, cols, rng), raw_dtype=GGMLQuantizationType.Q8_0)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(shape.n_embd, dtype=np.float32))

    kv = shape.n_head_kv * head_dim
    matrix("token_embd.weight", n_vocab, shape.n_embd)  # tied: the output reads it too
    for i in range(shape.n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", shape.n_embd, shape.n_embd)
        matrix(f"blk.{i}.attn_k.weight", kv, shape.n_embd)
        matrix(f"blk.{i}.attn_v.weight", kv, shape.n_embd)
        matrix(f"blk.{i}.attn_output.weight", shape.n_embd, shape.n_embd)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", shape.n_ff, shape.n_embd)
        matrix(f"blk.{i}.ffn_up.weight", shape.n_ff, shape.n_embd)
        matrix(f"blk.{i}.ffn_down.weight", shape.n_embd, shape.n_ff)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=Path, required=True, help="a GGUF with the tokenizer")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    began = time.perf_counter()
    path = write_model(args.vocab, args.shape, args.out, args.seed)
    size = path.stat().st_size / 1e9
    print(
        f"[make_model] {path}: {args.shape}, {size:.2f} GB in {time.perf_counter() - began:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
