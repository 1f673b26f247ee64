"""Sparse mixture-of-experts MLP (Qwen3-MoE: ``Qwen3MoeForCausalLM``).

Each token's router logits (a linear map to the experts) go through a float32 softmax; its
``num_experts_per_tok`` most probable experts run (renormalized to sum 1 when the checkpoint says
``norm_topk_prob``), and their SwiGLU outputs, weighted, are added (in expert order on the
reference path, in rank order on the fused one). Module names
follow the checkpoints (``mlp.gate.weight``, ``mlp.experts.N.{gate,up,down}_proj.weight``).

Two paths give the same values up to rounding. With the Triton kernels on (the model's ``kernels``
backend is :mod:`flashtree.kernels.gpu.fused`), :func:`~flashtree.kernels.gpu.moe.fused_moe` routes,
groups the tokens by expert and runs the grouped expert products on the device, with no host sync:
the engine replays MoE rounds as CUDA graphs. Otherwise (the CPU, or the Triton kernels off) the
reference path runs the experts one after another on the tokens routed to them, which reads the
routing on the host (one sync per MoE layer, free on a CPU); the engine then runs rounds without
graphs. On the CPU with the C++ kernels, the router is a C++ function whose every row's routing is
independent of the batch, and where every expert computes from GGUF blocks (or, in a dense float32 model,
the block kernel over its float32 weights: ``CausalLM.hold_float32_products``) the whole layer (router and
routed experts) is one C++ call with the reference path's arithmetic (:meth:`SparseMoE.kernel_table`),
which the layer stack also runs. Each expert is a :class:`~flashtree.models.transformer.MLP`;
:meth:`SparseMoE.fuse` stacks the experts' weights once (``gate_up [E, 2I, H]``, ``down [E, H, I]``) and leaves every expert's
parameters as views into them, so both paths read the same memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtree.kernels.cpu import fused as cpu_fused
from flashtree.kernels.cpu.quant_linear import Float32Rows, in_prompt_chunk
from flashtree.kernels.gpu import fused as gpu_fused
from flashtree.kernels.gpu.moe import fused_moe


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, normalize: bool, make_expert):
        """``make_expert(hidden, intermediate)`` builds one expert MLP."""
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(make_expert(hidden, intermediate) for _ in range(experts))
        self.top_k, self.normalize = top_k, normalize
        self.gate_up: torch.Tensor | None = None  # [E, 2I, H] after fuse(): each expert's gate rows, then up rows
        self.down: torch.Tensor | None = None  # [E, H, I] after fuse()
        self._kernel_table: tuple | None = None  # (the codes it was built for, the table, what it points to)

    @property
    def kernels(self):
        return self.experts[0].kernels

    @kernels.setter
    def kernels(self, backend) -> None:
        for expert in self.experts:
            expert.kernels = backend

    @property
    def fused(self) -> bool:
        """fuse() ran: the experts' weights are stacked, or (GGUF block experts) each expert reads its fused
        gate-up blocks."""
        return self.gate_up is not None or self.experts[0].gate_up is not None

    @property
    def routes_on_device(self) -> bool:
        """The forward runs the fused kernels (no host sync), not the reference path."""
        return self.kernels is gpu_fused and self.gate_up is not None

    def fuse(self) -> None:
        """Stack the experts' weights (expert by expert: each one's own tensors are freed as it is
        copied) and make every expert's parameters, and its fused ``gate_up``, views into the stacks.
        Experts whose matrices are GGUF blocks (their weights empty: ``quantized_weights.py``) stay
        as they are, each reading its own blocks (the reference path)."""
        weight = self.experts[0].gate_proj.weight
        if weight.numel() == 0:
            for expert in self.experts:
                expert.gate_up = weight.detach()  # (empty: the products read gate_up_quant / down_quant)
            return
        inter, hidden = weight.shape
        gate_up = weight.new_empty(len(self.experts), 2 * inter, hidden)  # [E, 2I, H]
        down = weight.new_empty(len(self.experts), hidden, inter)  # [E, H, I]
        for e, expert in enumerate(self.experts):
            gate_up[e, :inter] = expert.gate_proj.weight.detach()
            gate_up[e, inter:] = expert.up_proj.weight.detach()
            down[e] = expert.down_proj.weight.detach()
            expert.gate_proj.weight.data = gate_up[e, :inter]
            expert.up_proj.weight.data = gate_up[e, inter:]
            expert.down_proj.weight.data = down[e]
            expert.gate_up = gate_up[e]
        self.gate_up, self.down = gate_up, down

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` in x's dtype, expert ids ``[T, k]``) for tokens ``x [T, hidden]``."""
        if self.kernels is cpu_fused and x.dtype == torch.float32:  # (the one-call path's router: a row's
            return cpu_fused.moe_route(x, self.gate.weight, self.top_k, self.normalize)  # routing never depends on T)
        probs = F.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, hidden]
        if self.routes_on_device:
            return fused_moe(flat, self.gate.weight, self.gate_up, self.down, self.top_k, self.normalize).view(shape)
        table = self.kernel_table()
        if table is not None and flat.dtype == torch.float32 and not self._float32_prompt_chunk():
            return cpu_fused.moe_layer(flat, table).view(shape)
        return self.reference(flat).view(shape)

    def _float32_prompt_chunk(self) -> bool:
        """The experts hold float32 weights (a dense model's, CausalLM.hold_float32_products) and a prompt chunk
        runs: its products go to F.linear, through the reference path (as a dense layer's do)."""
        return isinstance(self.experts[0].gate_up_quant, Float32Rows) and in_prompt_chunk()

    def kernel_table(self) -> torch.Tensor | None:
        """With the CPU kernels and every expert's products held by the block kernel (GGUF blocks, or float32
        rows): the layer's operands for the one-call path (``cpu_fused.moe_layer``, also what the layer stack
        runs: the reference path's arithmetic, bit for bit, without a Python step per expert), ``[6]`` int64: the
        router's weight, a ``[E, 4]`` table of each expert's gate-up (code, operand) and down (code, operand), E,
        k, normalize, the experts' width; else None. Rebuilt when the products' codes change (int8 activations
        switched)."""
        first = self.experts[0]
        if self.kernels is not cpu_fused or first.gate_up_quant is None or first.down_quant is None:
            return None
        codes = (first.gate_up_quant.kernel_code, first.down_quant.kernel_code)
        if self._kernel_table is None or self._kernel_table[0] != codes:
            experts = torch.tensor([[e.gate_up_quant.kernel_code, e.gate_up_quant.kernel_operand,
                                     e.down_quant.kernel_code, e.down_quant.kernel_operand] for e in self.experts],
                                   dtype=torch.int64)  # [E, 4]
            router = self.gate.weight.detach().contiguous()  # [E, H] float32
            table = torch.tensor([router.data_ptr(), experts.data_ptr(), len(self.experts), self.top_k,
                                  int(self.normalize), first.down_quant.in_features], dtype=torch.int64)
            self._kernel_table = codes, table, (router, experts)  # (the operands stay alive with the table)
        return self._kernel_table[1]

    def reference(self, flat: torch.Tensor) -> torch.Tensor:
        """The experts one after another on the tokens routed to them: ``[T, hidden]`` -> ``[T, hidden]``."""
        weights, ids = self.route(flat)
        out = torch.zeros_like(flat)
        for expert in ids.unique().tolist():  # (the host sync of this path)
            rank, token = torch.where(ids.T == expert)  # tokens routed to it, in rank order
            y = self.experts[expert](flat[token]) * weights[token, rank, None]  # [t, hidden]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def routes_on_host(model: nn.Module) -> bool:
    """Some sparse MoE layer of ``model`` reads its routing on the host (the reference path), so
    its forwards cannot be captured as CUDA graphs."""
    return any(isinstance(m, SparseMoE) and not m.routes_on_device for m in model.modules())


def per_expert_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with stacked expert tensors (``mlp.experts.gate_up_proj [E, 2I, H]`` and
    ``mlp.experts.down_proj [E, H, I]``, newer transformers' in-memory layout) split into the
    checkpoints' per-expert names; other tensors as they are (``weights`` itself when none is
    stacked: a mapping that reads its tensors on demand is not read here)."""
    if not any(name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) for name in weights):
        return weights
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
