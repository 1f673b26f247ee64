"""An independent reference of the DFlash drafter's forward, written from DESIGN.md section 2: one
row, everything recomputed from the checkpoint files and the transformers target (no cache)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Hugging Face rotate-half RoPE; x [n, heads, d], positions [n]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv[None]  # [n, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


@torch.no_grad()
def reference_draft_logits(hf, drafter_dir: Path, context: list[int], bonus: int,
                           block_size: int | None = None) -> torch.Tensor:
    """DESIGN.md section 2 for one row, recomputing everything (no cache): ``[b-1, V]``."""
    cfg = json.loads((drafter_dir / "config.json").read_text())
    w = safetensors.torch.load_file(str(drafter_dir / "model.safetensors"))
    ids, mask = cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["mask_token_id"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    b, n = block_size or cfg["block_size"], len(context)

    def linear(x, name):  # a bias is there when config.json says attention_bias
        return x @ w[name + ".weight"].T + w.get(name + ".bias", 0.0)

    states = hf(torch.tensor([context]), output_hidden_states=True).hidden_states
    ctx = rms(torch.cat([states[i + 1][0] for i in ids], -1) @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = hf.get_input_embeddings()(torch.tensor([bonus] + [mask] * (b - 1)))  # [b, H]
    positions = torch.arange(n + b)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        window = cfg["sliding_window"] if cfg["layer_types"][layer] == "sliding_attention" else None
        h = rms(x, w[p + "input_layernorm.weight"])
        both = torch.cat([ctx, h])  # [n+b, H]: context K/V skip the input norm
        q = rms(linear(h, p + "self_attn.q_proj").view(b, heads, hd), w[p + "self_attn.q_norm.weight"])
        k = rms(linear(both, p + "self_attn.k_proj").view(n + b, kv, hd), w[p + "self_attn.k_norm.weight"])
        v = linear(both, p + "self_attn.v_proj").view(n + b, kv, hd)
        q, k = rotate(q, positions[n:]), rotate(k, positions)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)  # [heads, b, n+b]
        if window is not None:
            hidden_ctx = torch.arange(n + b) < n - window  # context older than the window
            scores = scores.masked_fill(hidden_ctx, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(b, heads * hd)
        x = x + linear(attn, p + "self_attn.o_proj")
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"].T
    return hf.lm_head(rms(x, w["norm.weight"])[1:])
