"""Sparse mixture-of-experts MLP (Qwen3-MoE: ``Qwen3MoeForCausalLM``).

Each token's router logits (a linear map to the experts) go through a float32 softmax; its
``num_experts_per_tok`` most probable experts run (renormalized to sum 1 when the checkpoint says
``norm_topk_prob``), and their SwiGLU outputs, weighted, are added in expert order. Module names
follow the checkpoints (``mlp.gate.weight``, ``mlp.experts.N.{gate,up,down}_proj.weight``).

This is the reference path: experts run one after another on the tokens routed to them, which
needs the routing on the host (one sync per MoE layer), so the engine runs MoE targets without CUDA
graphs until a grouped-GEMM kernel replaces it. Each expert is a :class:`~flashtree.models.transformer.MLP`,
so its gate and up projections fuse and the fused silu-mul kernels apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, normalize: bool, make_expert):
        """``make_expert(hidden, intermediate)`` builds one expert MLP."""
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(make_expert(hidden, intermediate) for _ in range(experts))
        self.top_k, self.normalize = top_k, normalize

    @property
    def kernels(self):
        return self.experts[0].kernels

    @kernels.setter
    def kernels(self, backend) -> None:
        for expert in self.experts:
            expert.kernels = backend

    @property
    def fused(self) -> bool:
        return all(expert.fused for expert in self.experts)

    def fuse(self) -> None:
        for expert in self.experts:
            expert.fuse()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` in x's dtype, expert ids ``[T, k]``) for tokens ``x [T, hidden]``."""
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, hidden]
        weights, ids = self.route(flat)
        out = torch.zeros_like(flat)
        for expert in ids.unique().tolist():  # (the host sync of this path)
            rank, token = torch.where(ids.T == expert)  # tokens routed to it, in rank order
            y = self.experts[expert](flat[token]) * weights[token, rank, None]  # [t, hidden]
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(shape)


def per_expert_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with stacked expert tensors (``mlp.experts.gate_up_proj [E, 2I, H]`` and
    ``mlp.experts.down_proj [E, H, I]``, newer transformers' in-memory layout) split into the
    checkpoints' per-expert names; other tensors as they are."""
    out = {}
    for name, tensor in weights.items():
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
            out[name] = tensor
            continue
        for expert, matrix in enumerate(tensor):
            if kind == "down_proj":
                out[f"{prefix}.{expert}.down_proj.weight"] = matrix
            else:
                gate, up = matrix.chunk(2, dim=0)
                out[f"{prefix}.{expert}.gate_proj.weight"] = gate
                out[f"{prefix}.{expert}.up_proj.weight"] = up
    return out
