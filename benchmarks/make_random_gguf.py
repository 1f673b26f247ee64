"""A GGUF of a Qwen3-1.7B-shaped (or Qwen3-30B-A3B-shaped) model with random Q4_0 (or Q4_K) weights, for CPU speed comparisons.

The body has Qwen3-1.7B's shape (``qwen3`` architecture: 28 layers, hidden 2048, 16 heads, 8 KV
heads of 128, MLP 6144, q/k norms, tied embeddings); the vocabulary and tokenizer are SmolLM2's,
copied from the embedded GGUF (no Qwen tokenizer is available offline), so the embedding is
49,152 rows instead of 151,936. Q4_0 blocks are written directly (random nibbles, one fp16 scale
per 32 weights), norms are ones: a model that runs, not one that says anything.

    python benchmarks/make_random_gguf.py --out /tmp/qwen3-1.7b-shape.q4_0.gguf

``--shape qwen3-30b-a3b`` writes the MoE body instead (``qwen3moe``: hidden 2048, 32 heads, 4 KV heads
of 128, 128 experts of 768, top-8 renormalized, F32 routers with random weights, so routing is near
uniform); ``--layers N`` keeps the first N layers of either (48 make the 17 GB model). ``--type q4_k``
writes the dense body's matrices as random Q4_K super-blocks, ``--type q4_k_m`` with Q6_K for attn_v,
ffn_down and the tied embedding (llama.cpp's Q4_K_M mix, simplified).
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

SHAPES = {
    "qwen3-1.7b": dict(layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=6144),
    "qwen3-30b-a3b": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
                          experts=128, experts_used=8, expert_intermediate=768),
}
COPIED_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
               "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
               "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template",
               "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")


def q4_0(rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random Q4_0 bytes of a ``[rows, cols]`` weight (cols a multiple of 32): per block of 32, an
    fp16 scale then 16 bytes of 4-bit values."""
    blocks = rows * cols // 32
    raw = np.empty((blocks, 18), dtype=np.uint8)
    raw[:, :2] = np.frombuffer(np.full(blocks, scale, dtype=np.float16).tobytes(), dtype=np.uint8).reshape(-1, 2)
    raw[:, 2:] = rng.integers(0, 256, size=(blocks, 16), dtype=np.uint8)
    return raw.reshape(rows, cols // 32 * 18)


def q4_k(rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random Q4_K bytes (cols a multiple of 256): per super-block fp16 d and dmin, 12 bytes of 6-bit
    sub-block scales and mins, 128 bytes of nibbles; d and dmin chosen so weights span about
    +-8 ``scale``, like :func:`q4_0`'s."""
    blocks = rows * cols // 256
    raw = rng.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    raw[:, 0:2] = _fp16_bytes(blocks, 16 * scale / (63 * 15))
    raw[:, 2:4] = _fp16_bytes(blocks, 8 * scale / 63)
    return raw.reshape(rows, cols // 256 * 144)


def q6_k(rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random Q6_K bytes (cols a multiple of 256): 128 bytes of low nibbles, 64 of high bit pairs,
    16 int8 scales (0..127) per 16 weights, fp16 d; weights span about +-8 ``scale``."""
    blocks = rows * cols // 256
    raw = rng.integers(0, 256, size=(blocks, 210), dtype=np.uint8)
    raw[:, 192:208] = rng.integers(0, 128, size=(blocks, 16), dtype=np.uint8)
    raw[:, 208:210] = _fp16_bytes(blocks, 8 * scale / (127 * 32))
    return raw.reshape(rows, cols // 256 * 210)


def _fp16_bytes(count: int, value: float) -> np.ndarray:
    return np.frombuffer(np.full(count, value, dtype=np.float16).tobytes(), dtype=np.uint8).reshape(-1, 2)


# --type: the matrices' block type, and Q4_K_M's Q6_K parts (llama.cpp's mix, simplified: every attn_v
# and ffn_down, and the tied embedding / output)
BLOCK_WRITERS = {"Q4_0": (q4_0, gguf.GGMLQuantizationType.Q4_0), "Q4_K": (q4_k, gguf.GGMLQuantizationType.Q4_K),
                 "Q6_K": (q6_k, gguf.GGMLQuantizationType.Q6_K)}
FILE_TYPES = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_S,
              "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}


def type_of(file_type: str, name: str) -> str:
    """The block type of matrix ``name`` in a file of ``file_type``."""
    if file_type == "q4_0":
        return "Q4_0"
    if file_type == "q4_k_m" and (name == "token_embd.weight" or name.endswith(("attn_v.weight", "ffn_down.weight"))):
        return "Q6_K"
    return "Q4_K"


def copy_field(writer: gguf.GGUFWriter, reader: gguf.GGUFReader, key: str) -> None:
    field = reader.fields.get(key)
    if field is None:
        return
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        values = [field.parts[i].tobytes().decode() if field.types[1] == gguf.GGUFValueType.STRING
                  else field.parts[i].tolist()[0] for i in field.data]
        writer.add_array(key, values)
    elif kind == gguf.GGUFValueType.STRING:
        writer.add_string(key, field.parts[field.data[0]].tobytes().decode())
    elif kind == gguf.GGUFValueType.BOOL:
        writer.add_bool(key, bool(field.parts[field.data[0]][0]))
    else:
        writer.add_uint32(key, int(field.parts[field.data[0]][0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: the shape's)")
    parser.add_argument("--type", choices=sorted(FILE_TYPES), default="q4_0",
                        help="the matrices' blocks: q4_0, q4_k (all Q4_K), q4_k_m (Q6_K for attn_v, ffn_down and "
                             "the tied embedding; dense shapes only)")
    args = parser.parse_args()
    if args.type != "q4_0" and args.shape != "qwen3-1.7b":
        parser.error(f"--type {args.type} is for the dense shape (qwen3-1.7b); the MoE body is written in Q4_0")
    from flashtree.models.embedded import EMBEDDED_MODELS, embedded_gguf_path

    donor = gguf.GGUFReader(str(embedded_gguf_path(EMBEDDED_MODELS["smollm2"])))
    vocab = len(donor.fields["tokenizer.ggml.tokens"].data)
    s, rng = dict(SHAPES[args.shape]), np.random.default_rng(args.seed)
    s["layers"] = args.layers or s["layers"]
    moe = "experts" in s
    writer = gguf.GGUFWriter(args.out, "qwen3moe" if moe else "qwen3")
    writer.add_block_count(s["layers"])
    writer.add_context_length(4096)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if moe:
        writer.add_expert_count(s["experts"])
        writer.add_expert_used_count(s["experts_used"])
        writer.add_expert_feed_forward_length(s["expert_intermediate"])
        writer.add_expert_weights_norm(True)
    writer.add_file_type(FILE_TYPES[args.type])
    writer.add_quantization_version(2)
    for key in COPIED_KEYS:
        copy_field(writer, donor, key)
    q4 = gguf.GGMLQuantizationType.Q4_0
    ones = np.ones(s["hidden"], dtype=np.float32)

    def matrix(name: str, rows: int, cols: int, scale: float = 0.004) -> None:
        write, qtype = BLOCK_WRITERS[type_of(args.type, name)]
        writer.add_tensor(name, write(rows, cols, rng, scale), raw_dtype=qtype)  # (its shape: bytes per row)

    matrix("token_embd.weight", vocab, s["hidden"], 0.02)
    writer.add_tensor("output_norm.weight", ones)
    q_width, kv_width = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(p + "ffn_norm.weight", ones)
        writer.add_tensor(p + "attn_q_norm.weight", np.ones(s["head_dim"], dtype=np.float32))
        writer.add_tensor(p + "attn_k_norm.weight", np.ones(s["head_dim"], dtype=np.float32))
        matrix(p + "attn_q.weight", q_width, s["hidden"])
        matrix(p + "attn_k.weight", kv_width, s["hidden"])
        matrix(p + "attn_v.weight", kv_width, s["hidden"])
        matrix(p + "attn_output.weight", s["hidden"], q_width)
        if moe:
            experts, width = s["experts"], s["expert_intermediate"]
            writer.add_tensor(p + "ffn_gate_inp.weight", rng.normal(0, 0.02, (experts, s["hidden"])).astype(np.float32))
            for part, rows, cols in (("gate", width, s["hidden"]), ("up", width, s["hidden"]), ("down", s["hidden"], width)):
                stacked = q4_0(experts * rows, cols, rng, 0.004).reshape(experts, rows, -1)  # [E, rows, bytes]
                writer.add_tensor(p + f"ffn_{part}_exps.weight", stacked, raw_dtype=q4)
            continue
        matrix(p + "ffn_gate.weight", s["intermediate"], s["hidden"])
        matrix(p + "ffn_up.weight", s["intermediate"], s["hidden"])
        matrix(p + "ffn_down.weight", s["hidden"], s["intermediate"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(args.out)


if __name__ == "__main__":
    main()
