"""GGUF matrices in the types gguf-py cannot quantize (the k-quants, the 4-bit codebooks), for tests.

:func:`random_blocks` writes valid raw blocks of any supported type: random quant bits and small
positive fp16 scales at the byte offsets ggml's block layouts give them. :func:`decode_q4_k` and
:func:`decode_q6_k` decode the two types of a Q4_K_M file from ggml's block definitions, written
here independently of gguf-py, so a test can check gguf-py's decoder (which the converter uses) and
whatever kernel reads the blocks against a second reading of the format.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from tests.support.checkpoints import (
    decisive_weights,
    gguf_name,
    state_dict,
    tiny_model,
    write_tiny_gguf,
)

QK_K = 256  # weights per k-quant super-block

# byte offsets of each type's fp16 scale fields in its block (ggml's block_* structs)
FP16_FIELDS = {
    QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.IQ4_NL: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.IQ4_XS: (0,),
}


def random_blocks(rows: int, columns: int, qtype: QT, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """``uint8 [rows, columns / weights per block * block bytes]``: random quants, every fp16 scale
    field drawn from [scale / 2, scale]."""
    weights_per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if columns % weights_per_block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {weights_per_block} weights, got {columns}")
    blocks = rng.integers(0, 256, size=(rows, columns // weights_per_block, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        values = rng.uniform(scale / 2, scale, size=blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K super-block from its 12 bytes ``[..., 12]``."""
    q = packed.astype(np.int32)
    scales, mins = np.empty(q.shape[:-1] + (8,), np.int32), np.empty(q.shape[:-1] + (8,), np.int32)
    for j in range(8):
        if j < 4:
            scales[..., j], mins[..., j] = q[..., j] & 63, q[..., j + 4] & 63
        else:
            scales[..., j] = (q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4)
            mins[..., j] = (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)
    return scales, mins


def decode_q4_k(raw: np.ndarray, columns: int) -> np.ndarray:
    """float32 ``[rows, columns]`` of Q4_K blocks ``uint8 [rows, columns / 256 * 144]``: per 32-weight
    sub-block ``d * scale * q - dmin * min``, the low nibbles of 32 bytes then their high nibbles."""
    blocks = raw.reshape(raw.shape[0], columns // QK_K, 144)  # [R, S, 144]
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [R, S]
    scales, mins = _q4_k_scales(blocks[..., 4:16])  # [R, S, 8]
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)  # [R, S, 4 pairs of sub-blocks, 32 bytes]
    quants = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(*blocks.shape[:2], 8, 32)  # [R, S, 8, 32]
    step, offset = d[..., None] * scales.astype(np.float32), dmin[..., None] * mins.astype(np.float32)  # [R, S, 8]
    out = step[..., None] * quants.astype(np.float32) - offset[..., None]
    return out.reshape(raw.shape[0], columns)


def decode_q6_k(raw: np.ndarray, columns: int) -> np.ndarray:
    """float32 ``[rows, columns]`` of Q6_K blocks ``uint8 [rows, columns / 256 * 210]``: per 16 weights
    ``d * scale * (q - 32)``, q's low 4 bits from ``ql`` and high 2 from ``qh``, in two halves of 128."""
    blocks = raw.reshape(raw.shape[0], columns // QK_K, 210).astype(np.int32)  # [R, S, 210]
    ql, qh, scales = blocks[..., :128], blocks[..., 128:192], blocks[..., 192:208]
    d = _fp16(blocks[..., 208:210].astype(np.uint8))  # [R, S]
    scales = scales.astype(np.uint8).view(np.int8).astype(np.int32)  # [R, S, 16]
    out = np.empty((*blocks.shape[:2], QK_K), np.float32)
    for half in range(2):
        low, high, sc = ql[..., 64 * half:64 * half + 64], qh[..., 32 * half:32 * half + 32], scales[..., 8 * half:]
        for quarter in range(4):  # weights 32 * quarter .. + 31 of this half
            nibbles = low[..., 32 * (quarter % 2):32 * (quarter % 2) + 32]
            nibbles = nibbles & 0xF if quarter < 2 else nibbles >> 4
            q = (nibbles | (((high >> (2 * quarter)) & 3) << 4)) - 32  # [R, S, 32]
            for part in range(2):  # 16 weights per scale
                scale = sc[..., 2 * quarter + part]
                start = 128 * half + 32 * quarter + 16 * part
                step = d * scale.astype(np.float32)  # [R, S]
                out[..., start:start + 16] = step[..., None] * q[..., 16 * part:16 * part + 16].astype(np.float32)
    return out.reshape(raw.shape[0], columns)


def scaled_random_blocks(rows: int, columns: int, qtype: QT, rng: np.random.Generator,
                         largest: float = 0.3) -> np.ndarray:
    """:func:`random_blocks` whose dequantized weights reach about ``largest`` in magnitude."""
    seed = int(rng.integers(2**31))
    probe = random_blocks(rows, columns, qtype, np.random.default_rng(seed))
    reach = float(np.abs(gguf.quants.dequantize(probe, qtype)).max())
    return random_blocks(rows, columns, qtype, np.random.default_rng(seed), scale=0.01 * largest / reach)


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """Q4_K blocks ``uint8 [rows, columns / 256 * 144]`` of float32 ``weight [rows, columns]``: per
    32-weight sub-block a step ``(max - min(min, 0)) / 15`` and an offset, both 6-bit multiples of the
    super-block's fp16 ``d`` / ``dmin`` (a plain encoder, not ggml's searched one; any valid one will do)."""
    rows, columns = weight.shape
    w = weight.reshape(rows, columns // QK_K, 8, 32).astype(np.float32)  # [R, S, 8, 32]
    low = np.minimum(w.min(-1), 0)  # [R, S, 8]
    step, offset = (w.max(-1) - low) / 15, -low
    d = (step.max(-1) / 63).astype(np.float16)  # [R, S]
    dmin = (offset.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d[..., None].astype(np.float32), 1e-30)), 0, 63).astype(np.int32)
    m = np.clip(np.round(offset / np.maximum(dmin[..., None].astype(np.float32), 1e-30)), 0, 63).astype(np.int32)
    unit = d[..., None].astype(np.float32) * sc  # [R, S, 8]
    shifted = w + (dmin[..., None].astype(np.float32) * m)[..., None]
    q = np.clip(np.round(shifted / np.where(unit > 0, unit, 1)[..., None]), 0, 15).astype(np.uint8)  # [R, S, 8, 32]
    packed = np.empty((rows, columns // QK_K, 12), np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(rows, columns // QK_K, 128)
    head = np.stack([d, dmin], -1).view(np.uint8).reshape(rows, columns // QK_K, 4)
    return np.concatenate([head, packed, qs], -1).reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """Q6_K blocks ``uint8 [rows, columns / 256 * 210]`` of float32 ``weight``: per 16 weights an int8
    scale (a multiple of the super-block's fp16 ``d``) and 6-bit ``q - 32``."""
    rows, columns = weight.shape
    w = weight.reshape(rows, columns // QK_K, 16, 16).astype(np.float32)  # [R, S, 16, 16]
    step = np.abs(w).max(-1) / 31  # [R, S, 16]
    d = (step.max(-1) / 127).astype(np.float16)  # [R, S]
    sc = np.clip(np.round(step / np.maximum(d[..., None].astype(np.float32), 1e-30)), 0, 127).astype(np.int32)
    unit = d[..., None].astype(np.float32) * sc
    q = (np.clip(np.round(w / np.where(unit > 0, unit, 1)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, columns // QK_K, 2, 4, 32)  # [R, S, half, quarter, 32]
    low, high = q & 0xF, q >> 4
    ql = np.concatenate([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], -1)  # [R, S, 2, 64]
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)  # [R, S, 2, 32]
    scales = sc.astype(np.int8).view(np.uint8)  # [R, S, 16]
    parts = [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), scales,
             d[..., None].view(np.uint8).reshape(rows, -1, 2)]
    return np.concatenate(parts, -1).reshape(rows, -1)


ENCODERS = {QT.Q4_K: quantize_q4_k, QT.Q6_K: quantize_q6_k}


def kquant_overrides(model, qtypes: dict[str, QT], default: QT, seed: int = 0,
                     encode: bool = False) -> dict[str, tuple[np.ndarray, QT]]:
    """Blocks for every matrix of ``model`` (``write_tiny_gguf``'s raw_overrides), of the type
    ``qtypes`` gives its GGUF part (``attn_v``, ``ffn_down``, ``output``, ``token_embd`` ...), else
    ``default``: the model's own weights encoded (``encode``, Q4_K / Q6_K), else random blocks."""
    rng = np.random.default_rng(seed)
    overrides = {}
    for hf_name, tensor in state_dict(model).items():
        if tensor.dim() != 2:
            continue
        name = gguf_name(hf_name)
        qtype = qtypes.get(name.split(".")[-2], default)
        blocks = ENCODERS[qtype](tensor.float().numpy()) if encode else scaled_random_blocks(*tensor.shape, qtype, rng)
        overrides[name] = (blocks, qtype)
    return overrides


Q4_K_M = {"attn_v": QT.Q6_K, "ffn_down": QT.Q6_K, "output": QT.Q6_K}  # the rest Q4_K, as llama.cpp mixes it


def q4_k_m_gguf(path, tied: bool = False):
    """A tiny qwen2 (rows of 256 and 512 weights: whole super-blocks) written as a Q4_K_M-mix GGUF, its
    own decisive weights encoded; returns ``path``."""
    model = decisive_weights(tiny_model("qwen2", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=3, tie_word_embeddings=tied))
    write_tiny_gguf(path, model, QT.F32, raw_overrides=kquant_overrides(model, Q4_K_M, QT.Q4_K, encode=True))
    return path
