"""Triton kernels of a decoder layer's small ops (behind :mod:`flashtree.kernels.gpu.fused`): residual add +
RMSNorm, silu * up, and q/k norm + rotary + KV-cache write. Every program handles one token (and one head,
or one column block); arithmetic is float32 with one rounding to the output dtype."""

import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, sum_ptr, normed_ptr, width, eps,
                         copy_ptr, copy_rows_ptr, copy_stride, BLOCK: tl.constexpr, COPY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
    total = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * width + cols, total, mask=inside)
    if COPY:  # the sum also goes to row copy_rows[row] of a strided buffer (a feature sink)
        to = tl.load(copy_rows_ptr + row)
        tl.store(copy_ptr + to * copy_stride + cols, total.to(copy_ptr.dtype.element_ty), mask=inside)
    s = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=0) / width + eps)
    w = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * width + cols, (s * inv_rms * w).to(normed_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _qkv_norm_rope_write_kernel(
        qkv_ptr, qk_norm_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, cache_pos_ptr,
        q_out_ptr, k_cache_ptr, v_cache_ptr,
        new_tokens, heads, kv_heads, eps,
        cache_slot_stride, cache_head_stride, cache_pos_stride,
        HALF: tl.constexpr, QK_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # flat index b * N + n
    head = tl.program_id(1)  # 0..H-1: a query head; H..H+KVH-1: a key/value head
    half = tl.arange(0, HALF)
    width = (heads + 2 * kv_heads) * 2 * HALF
    base = qkv_ptr + token * width + head * 2 * HALF
    lo = tl.load(base + half).to(tl.float32)
    hi = tl.load(base + HALF + half).to(tl.float32)
    if QK_NORM:
        norm_ptr = qk_norm_ptr + (head >= heads).to(tl.int64) * 2 * HALF  # row 0: q's weight, row 1: k's
        inv_rms = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF) + eps)
        lo = (lo * inv_rms * tl.load(norm_ptr + half).to(tl.float32))
        hi = (hi * inv_rms * tl.load(norm_ptr + HALF + half).to(tl.float32))
        lo = lo.to(q_out_ptr.dtype.element_ty).to(tl.float32)  # the reference rounds the normed q/k
        hi = hi.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * 2 * HALF + half).to(tl.float32)
    sin = tl.load(sin_ptr + position * 2 * HALF + half).to(tl.float32)
    rot_lo = lo * cos - hi * sin
    rot_hi = hi * cos + lo * sin
    if head < heads:
        b = token // new_tokens
        n = token % new_tokens
        out = q_out_ptr + ((b * heads + head) * new_tokens + n) * 2 * HALF
        tl.store(out + half, rot_lo.to(q_out_ptr.dtype.element_ty))
        tl.store(out + HALF + half, rot_hi.to(q_out_ptr.dtype.element_ty))
    else:
        kv_head = head - heads
        entry = (tl.load(slots_ptr + token) * cache_slot_stride + kv_head * cache_head_stride
                 + tl.load(cache_pos_ptr + token) * cache_pos_stride)
        tl.store(k_cache_ptr + entry + half, rot_lo.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_cache_ptr + entry + HALF + half, rot_hi.to(k_cache_ptr.dtype.element_ty))
        v_base = qkv_ptr + token * width + (heads + kv_heads + kv_head) * 2 * HALF
        tl.store(v_cache_ptr + entry + half, tl.load(v_base + half))
        tl.store(v_cache_ptr + entry + HALF + half, tl.load(v_base + HALF + half))
