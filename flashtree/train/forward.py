"""The drafter's training forward: every block of every sequence in one pass.

It runs the inference drafter's own modules (``fc``, ``hidden_norm``, each layer's projections,
q/k norms, MLP and norms, a DFlash2 layer's convolutions, the final ``norm``, its RoPE table; the
target's embedding) in the order :class:`flashtree.models.dflash.DFlashDrafter` (or
:class:`flashtree.models.dflash2.DFlash2Drafter`) runs them at inference
(``observe`` for the context, ``draft_logits`` for a block), so a trained checkpoint drafts
exactly what training optimized. Only the key layout and mask differ:

- inference: per row, keys ``[context 0..start-1 ; block]``;
- training: per sequence, keys ``[context 0..N-1 ; block of anchor 0 ; block of anchor 1 ...]``
  with the block-sparse mask of :mod:`flashtree.train.masks` (a block sees the context before
  its anchor and its own slots), which gives every block the same keys it sees at inference.
A test checks the logits against the inference path.

Shapes: B sequences, N tokens, A anchors, b block size, Q = A*b queries, H heads, KVH kv heads,
D head dim, C = len(target_layer_ids) * hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashtree.models.dflash import DFlashDrafter
from flashtree.models.rope import apply_rotary
from flashtree.train.anchors import AnchorBlocks
from flashtree.train.masks import dense_block_mask, flex_block_mask

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None], torch.Tensor]


def context_kv(drafter: DFlashDrafter, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) ``[B, KVH, N, D]`` of the context features ``[B, N, C]`` at positions 0..N-1
    (what ``DFlashDrafter.observe`` writes into the drafter's cache)."""
    rows, width, _ = features.shape
    context = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.dtype)))  # [B, N, hidden]
    positions = torch.arange(width, device=features.device).expand(rows, -1)  # [B, N]
    rope = drafter.rope.lookup(positions)  # cos, sin [B, 1, N, D]
    return [layer.self_attn.key_value(context, rope) for layer in drafter.layers]


def block_layer(layer, x: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor], rope, attend: Attend,
                window: int | None, block_size: int) -> torch.Tensor:
    """One pre-norm Qwen3 layer over the block queries ``x [B, Q, hidden]`` (keys: context + blocks);
    a DFlash2 layer's attention and MLP each inside its grouped convolution (``models/dflash2.py``)."""
    attn = layer.self_attn
    rows, n_query, _ = x.shape

    def attention(h: torch.Tensor) -> torch.Tensor:
        q = attn.q_norm(attn.q_proj(h).view(rows, n_query, attn.heads, attn.head_dim))
        q = apply_rotary(q.transpose(1, 2), *rope)  # [B, H, Q, D]
        k, v = attn.key_value(h, rope)  # [B, KVH, Q, D] x2
        keys = torch.cat([ctx[0], k], dim=2)  # [B, KVH, N + Q, D]
        values = torch.cat([ctx[1], v], dim=2)  # [B, KVH, N + Q, D]
        out = attend(q, keys, values, window)  # [B, H, Q, D]
        return attn.o_proj(out.transpose(1, 2).reshape(rows, n_query, attn.heads * attn.head_dim))

    x = x + convolved(getattr(layer, "attention_conv", None), attention, layer.input_layernorm(x), block_size)
    return x + convolved(getattr(layer, "mlp_conv", None), layer.mlp, layer.post_attention_layernorm(x), block_size)


def convolved(conv, sublayer: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, block_size: int
              ) -> torch.Tensor:
    """``sublayer(h)`` for ``h [B, Q, hidden]`` (Q = A blocks of ``block_size``), inside ``conv``
    (a DFlash2 ``GroupedDynamicConv``, or None: no convolution), whose taps run within each block."""
    if conv is None:
        return sublayer(h)
    rows, n_query, hidden = h.shape

    def per_block(u: torch.Tensor) -> torch.Tensor:  # [B * A, b, hidden] -> the same
        return sublayer(u.reshape(rows, n_query, hidden)).reshape(-1, block_size, hidden)

    return conv.around(per_block, h.reshape(-1, block_size, hidden)).reshape(rows, n_query, hidden)


def make_attend(kind: str, positions: torch.Tensor, context_len: int, block_size: int) -> Attend:
    """``attend(q, k, v, window)``: SDPA with the dense mask, or flex attention with a BlockMask."""
    if kind == "flex":
        return _flex_attend(positions, context_len, block_size)
    masks: dict[int | None, torch.Tensor] = {}

    def attend(q, k, v, window):
        if window not in masks:
            masks[window] = dense_block_mask(positions, context_len, block_size, window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=masks[window], enable_gqa=q.shape[1] != k.shape[1])

    return attend


_compiled_flex = None


def _flex_attend(positions: torch.Tensor, context_len: int, block_size: int) -> Attend:
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    block_masks: dict = {}

    def attend(q, k, v, window):
        if window not in block_masks:
            block_masks[window] = flex_block_mask(positions, context_len, block_size, window)
        dtype = v.dtype  # under autocast, rotated q/k may be float32 while v is bf16
        return _compiled_flex(q.to(dtype), k.to(dtype), v, block_mask=block_masks[window],
                              enable_gqa=q.shape[1] != k.shape[1])

    return attend


def training_hidden(drafter: DFlashDrafter, features: torch.Tensor, blocks: AnchorBlocks,
                    attention: str = "dense") -> torch.Tensor:
    """Normed drafter outputs at slots 1..b-1 of every block: ``[B, A, b-1, hidden]``.

    features: ``[B, N, C]`` target context features; blocks: anchors of these sequences."""
    rows, anchors, block = blocks.block_ids.shape
    ctx = context_kv(drafter, features)
    attend = make_attend(attention, blocks.positions, features.shape[1], block)
    ids = blocks.block_ids.reshape(rows, anchors * block)  # [B, Q]
    x = drafter.embed_block(ids)  # [B, Q, hidden]
    rope = drafter.rope.lookup(blocks.block_positions.reshape(rows, anchors * block))  # [B, 1, Q, D] x2
    for index, layer in enumerate(drafter.layers):
        x = block_layer(layer, x, ctx[index], rope, attend, drafter.config.window(index), block)
    return drafter.norm(x).view(rows, anchors, block, -1)[:, :, 1:]  # [B, A, b-1, hidden]
