"""An independent reference of the DFlash2 drafter's proposal, written from the semantics in
flashtree/models/dflash2.py's docstring (learned from vLLM's qwen3_dflash2.py and llama.cpp's
dflash.cpp): one row, everything recomputed from the checkpoint files and the transformers target
(no cache, no flashtree module), each op spelled out."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import safetensors.torch
import torch
import torch.nn.functional as F

from tests.support.dflash_reference import rms, rotate


class Dflash2Proposal(NamedTuple):
    candidates: torch.Tensor  # [L, k] token ids, by descending lm_head logit
    scores: torch.Tensor  # [L, k] the walk's scores s_l(y_{l-1}, c)
    path: list[int]  # the greedy walk y_1..y_L
    log_probs: torch.Tensor  # [L, V] log q_l: log-softmax over the candidates, -inf elsewhere


def conv_side(x: torch.Tensor, base: torch.Tensor, coeffs: torch.Tensor, group_size: int) -> torch.Tensor:
    """y[i, c] = sum_t (base[t, c] + coeffs[i, t, c // group_size]) * x[i - t, c], zero before slot 0.
    x [b, H], base [K, H], coeffs [b, K, G]; loops over slots and taps."""
    b, hidden = x.shape
    channel_group = torch.arange(hidden) // group_size  # [H]
    out = torch.zeros_like(x)
    for i in range(b):
        for t in range(base.shape[0]):
            if i - t >= 0:
                out[i] += (base[t] + coeffs[i, t, channel_group]) * x[i - t]
    return out


def wrapped(x_normed: torch.Tensor, w: dict, prefix: str, taps: int, group_size: int, sublayer) -> torch.Tensor:
    """conv side 1 (sublayer (conv side 0 (x))), both sides' coefficients from one projection of x."""
    b, hidden = x_normed.shape
    groups = hidden // group_size
    coeffs = (x_normed @ w[prefix + ".kernel_projection.weight"].T).view(b, 2, taps, groups)
    base = w[prefix + ".base_kernel"]  # [2, K, H]
    inner = sublayer(conv_side(x_normed, base[0], coeffs[:, 0], group_size))
    return conv_side(inner, base[1], coeffs[:, 1], group_size)


@torch.no_grad()
def reference_dflash2(hf, drafter_dir: Path, context: list[int], bonus: int) -> Dflash2Proposal:
    cfg = json.loads((drafter_dir / "config.json").read_text())
    draft = cfg["dflash_config"]
    w = safetensors.torch.load_file(str(drafter_dir / "model.safetensors"))
    ids, mask, b = draft["target_layer_ids"], draft["mask_token_id"], draft["block_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    taps, group, top_k = draft["conv_kernel_size"], draft["conv_group_size"], draft["selector_top_k"]
    theta = cfg["rope_parameters"]["rope_theta"]
    n = len(context)

    states = hf(torch.tensor([context]), output_hidden_states=True).hidden_states
    ctx = rms(torch.cat([states[i + 1][0] for i in ids], -1) @ w["fc.weight"].T, w["hidden_norm.weight"])
    scale = draft.get("input_embedding_scale", 1.0)
    x = hf.get_input_embeddings()(torch.tensor([bonus] + [mask] * (b - 1))) * scale  # [b, H]
    positions = torch.arange(n + b)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        window = cfg["sliding_window"] if cfg["layer_types"][layer] == "sliding_attention" else None

        def attention(h, p=p, window=window):
            both = torch.cat([ctx, h])  # [n+b, H]: context K/V come from the context features alone
            q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(b, heads, hd), w[p + "self_attn.q_norm.weight"])
            k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(n + b, kv, hd), w[p + "self_attn.k_norm.weight"])
            v = (both @ w[p + "self_attn.v_proj.weight"].T).view(n + b, kv, hd)
            q, k = rotate(q, positions[n:], theta), rotate(k, positions, theta)
            k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)  # [heads, b, n+b]: non-causal
            if window is not None:
                logits = logits.masked_fill(torch.arange(n + b) < n - window, float("-inf"))
            out = torch.einsum("hqk,khd->qhd", logits.softmax(-1), v).reshape(b, heads * hd)
            return out @ w[p + "self_attn.o_proj.weight"].T

        def mlp(h, p=p):
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            return (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

        x = x + wrapped(rms(x, w[p + "input_layernorm.weight"]), w, p + "attention_conv", taps, group, attention)
        x = x + wrapped(rms(x, w[p + "post_attention_layernorm.weight"]), w, p + "mlp_conv", taps, group, mlp)

    hidden = rms(x, w["norm.weight"])[1:]  # [L, H], draft slots 1..b-1
    logits = hf.lm_head(hidden)  # [L, V]
    candidates = logits.argsort(dim=-1, descending=True)[:, :top_k]  # [L, k]
    unary = logits.gather(-1, candidates) * draft.get("output_multiplier", 1.0)
    cap = draft.get("final_logit_softcapping")
    if cap:
        unary = cap * torch.tanh(unary / cap)
    gates = hidden @ w["candidate_selector.hidden_projection.weight"].T  # [L, R]
    pred, succ = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
    previous, path, rows = bonus, [], []
    for slot in range(b - 1):
        row = torch.stack([unary[slot, j] + (pred[previous] * gates[slot] * succ[candidates[slot, j]]).sum()
                           for j in range(top_k)])  # [k]
        previous = int(candidates[slot, int(row.argmax())])
        path.append(previous)
        rows.append(row)
    scores = torch.stack(rows)  # [L, k]
    log_probs = torch.full_like(logits, float("-inf"))
    log_probs.scatter_(-1, candidates, scores.log_softmax(-1))
    return Dflash2Proposal(candidates, scores, path, log_probs)
