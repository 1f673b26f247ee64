"""The target decoder: Llama / SmolLM2 / Qwen2 / Qwen3 dense, written for batched tree verification.

Module names mirror Hugging Face's (``model.layers.N.self_attn.q_proj`` ...) so checkpoints load
as they are. A forward takes a :class:`ForwardBatch` (per-row new tokens, positions and mask),
writes the new tokens' K/V into the :class:`KVCache` scratch area, and returns logits for the
requested positions plus, on request, the hidden states after chosen decoder layers.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashtree.errors import ConfigError
from flashtree.kernels import gpu as gpu_kernels
from flashtree.kernels.cpu import fused as cpu_fused
from flashtree.kernels.cpu.layer_stack import LayerDims, LayerStack, LayerWeights
from flashtree.kernels.cpu.library import KernelUnavailable, load_kernels
from flashtree.kernels.cpu.quant_linear import (
    Float32Rows,
    QuantizedLinear,
    embedding,
    float32_rows,
    float32_rows_fit,
    linear,
    prompt_chunk,
)
from flashtree.kernels.feature_sink import FeatureSink, SinkSegment
from flashtree.kernels.gpu import exact as gpu_exact
from flashtree.kernels.gpu import fused as gpu_fused
from flashtree.kv.cache import KVCache
from flashtree.models.attention import attention_bias, masked_attention
from flashtree.models.batch import ForwardBatch, attention_mask
from flashtree.models.config import ModelConfig
from flashtree.models.moe import SparseMoE
from flashtree.models.rope import RotaryTable, apply_rotary

# With the paged attention in decode forwards only (``triton_attention`` None), prompt chunks of up to this many
# tokens a row attend through it too: a short chunk after a long cached prefix (a question after a shared system
# prompt) would otherwise gather every row's context pages for SDPA (on an H100 at the Qwen3-8B shape, 31 rows of
# 3 tokens over 2k cached tokens spent 23.5 of the step's ~45 ms gathering). Longer chunks keep SDPA.
SHORT_PREFILL_TOKENS = 64


def product(kernels):
    """The linear a model's layers call: the backend's (the exact backend's is row-invariant), else
    :func:`~flashtree.kernels.cpu.quant_linear.linear` (F.linear, or GGUF blocks where the layer has them)."""
    return linear if kernels is None else kernels.linear


def attention_kernel_fits(cfg) -> bool:
    """The Triton attention kernel handles this head layout (head_dim a power of two >= 16)."""
    head_dim = cfg.head_dim
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and cfg.num_attention_heads % cfg.num_key_value_heads == 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor, kernels,
                    copy_to: SinkSegment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); one kernel of ``kernels`` (a fused-kernel backend
        module, or None for torch ops). ``copy_to``: the sum also goes there (kernels/feature_sink.py),
        inside that kernel where the backend can."""
        if kernels is not None and copy_to is not None and kernels.ADD_RMS_NORM_COPIES:
            return kernels.add_rms_norm(x, residual, self.weight, self.eps, copy_to=copy_to)
        if kernels is not None:
            normed, total = kernels.add_rms_norm(x, residual, self.weight, self.eps)
        else:
            total = residual + x
            normed = self(total)
        if copy_to is not None:
            copy_to.write(total)
        return normed, total


def fuse_rows(*linears: nn.Linear, attr: str = "weight") -> torch.Tensor:
    """Concatenate the linears' weights (or biases) along the output dim and make each linear's
    parameter a view into the result, so fusing costs no extra memory."""
    fused = torch.cat([getattr(lin, attr).detach() for lin in linears])
    offset = 0
    for lin in linears:
        param = getattr(lin, attr)
        rows = param.shape[0]
        param.data = fused[offset:offset + rows]
        offset += rows
    return fused


def fuse_attention_projections(attn: nn.Module) -> None:
    """Concatenate an attention's q/k/v projections (weights, and biases when present) so one
    matmul computes all three, and stack its q/k norm weights for the fused kernels."""
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    attn.qkv_weight = fuse_rows(*projections)
    if attn.q_proj.bias is not None:
        attn.qkv_bias = fuse_rows(*projections, attr="bias")
    if attn.q_norm is not None:
        attn.qk_norm_weight = torch.stack([attn.q_norm.weight.detach(), attn.k_norm.weight.detach()])


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: torch.Tensor | None = None  # [2 * intermediate, hidden] after fuse()
        # GGUF blocks (models/quantized_weights.py), else None: every product reads them, and the fp32
        # weights they stand for are empty tensors
        self.gate_up_quant: QuantizedLinear | None = None
        self.down_quant: QuantizedLinear | None = None
        self.kernels = None  # fused-kernel backend (gpu_kernels / cpu_kernels) for silu * up, or None

    def fuse(self) -> None:
        """Concatenate gate and up so one matmul computes both (fewer launches per layer)."""
        self.gate_up = fuse_rows(self.gate_proj, self.up_proj)

    @property
    def fused(self) -> bool:
        return self.gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = product(self.kernels)(x, self.gate_up, None, self.gate_up_quant)
        if self.kernels is not None:
            act = self.kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return product(self.kernels)(act, self.down_proj.weight, None, self.down_quant)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_weight: torch.Tensor | None = None  # [(H + 2 KVH) * D, hidden] after fuse()
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_quant: QuantizedLinear | None = None  # GGUF blocks (see MLP)
        self.o_quant: QuantizedLinear | None = None
        self.qk_norm_weight: torch.Tensor | None = None  # [2, D]: q_norm then k_norm (fused kernel)
        self.kernels = None  # fused-kernel backend for q/k norm + rotary + KV write, or None
        self.fused_attention = False  # Triton attention read from the KV pages through the block table

    def fuse(self) -> None:
        fuse_attention_projections(self)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return product(self.kernels)(x, self.qkv_weight, self.qkv_bias, self.qkv_quant).split(
            [q_width, kv_width, kv_width], dim=-1)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                write_index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``rope``: cos, sin ``[B, 1, N, D]`` at the tokens' positions; with fused kernels, the
        whole ``[P, D]`` tables (the kernel looks positions up itself). ``x``: ``[B, N, hidden]``, or
        ``[1, T, hidden]`` for a packed batch (``batch.packing``: the projections run over the packed tokens,
        the attention over ``[B, N]``), and the output likewise."""
        b, n = batch.input_ids.shape
        if self.kernels is not None:
            qkv = product(self.kernels)(x, self.qkv_weight, self.qkv_bias, self.qkv_quant)  # [B, N, (H + 2 KVH) * D]
            q = self.kernels.qkv_norm_rope_write(
                unpacked(qkv, batch), self.heads, self.kv_heads, self.qk_norm_weight,
                self.q_norm.eps if self.q_norm else 0.0, *rope, batch.positions, cache.k[self.layer_index],
                cache.v[self.layer_index], write_index)  # [B, H, N, D]
        else:
            q = self._rotate_and_write(x, batch, cache, rope, write_index)
        if mask is None:  # the backend's attention reads lengths and new_mask itself
            extra = {} if batch.key_order is None else {"key_order": batch.key_order}  # (exact mode)
            if batch.packing is not None:  # (queries past a row's packed tokens need no keys)
                extra["counts"] = batch.packing.counts
            out = self.kernels.tree_attention(q, cache.k[self.layer_index], cache.v[self.layer_index],
                                              cache.block_table, batch.slots, batch.cache_lengths,
                                              batch.new_mask, **extra)  # [B, H, N, D]
        else:
            keys, values = cache.view(self.layer_index, batch.slots, batch.kv_len)
            out = masked_attention(q, keys, values, mask, batch.one_off_shape)  # [B, H, N, D]
        out = out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim)  # [B, N, H * D]
        if batch.packing is not None:
            out = batch.packing.gather(out)[None]  # [1, T, H * D]
        return product(self.kernels)(out, self.o_proj.weight, None, self.o_quant)

    def _rotate_and_write(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                          rope: tuple[torch.Tensor, torch.Tensor],
                          write_index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The torch-ops path: project, q/k norm, rotary, write K/V; returns q ``[B, H, N, D]``."""
        b, n = batch.input_ids.shape
        q, k, v = (unpacked(t, batch) for t in self.project_qkv(x))  # [B, N, width] each
        q = q.view(b, n, self.heads, self.head_dim)
        k = k.view(b, n, self.kv_heads, self.head_dim)
        v = v.view(b, n, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, N, D]
        k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, KVH, N, D]
        cache.write_at(self.layer_index, write_index, k.transpose(1, 2), v)
        return q


def unpacked(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """A packed batch's ``[1, T, width]`` at its padded entries, ``[B, N, width]`` (``TokenPacking.scatter``);
    ``x`` as it is for a padded batch."""
    if batch.packing is None:
        return x
    rows, width = batch.input_ids.shape
    return batch.packing.scatter(x[0], rows, width)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_index)
        moe = cfg.moe
        if moe is not None and moe.sparse(layer_index):
            self.mlp = SparseMoE(cfg.hidden_size, moe.moe_intermediate_size, moe.num_experts, moe.num_experts_per_tok,
                                 moe.norm_topk_prob, MLP)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache,
                rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                write_index: tuple[torch.Tensor, torch.Tensor], kernels,
                keep_input: list | SinkSegment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`prenorm_layer`."""
        return prenorm_layer(self, x, residual, kernels,
                             lambda h: self.self_attn(h, batch, cache, rope, mask, write_index), keep_input)


def prenorm_layer(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, kernels,
                  attend: Callable[[torch.Tensor], torch.Tensor],
                  keep_input: list | SinkSegment | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm decoder layer (``input_layernorm``, attention, ``post_attention_layernorm``,
    ``mlp``) whose input is ``x + residual`` (``x`` alone for the first layer): the previous
    layer's MLP output is added here, inside the fused norm. Returns (MLP output, residual),
    whose sum is the layer's output. ``attend`` runs the attention on the normed input; ``kernels``
    is the fused-kernel backend module or None. ``keep_input``: a list to append the layer's input
    to (the sum the fused norm makes anyway: the previous layer's output, with no extra add), or a
    sink segment to write it into (by the fused norm's kernel where it can)."""
    sink = keep_input if isinstance(keep_input, SinkSegment) else None
    if residual is None:
        norm = layer.input_layernorm
        h, residual = (norm(x) if kernels is None else kernels.rms_norm(x, norm.weight, norm.eps)), x
        if sink is not None:
            sink.write(x)
    else:
        h, residual = layer.input_layernorm.add_forward(x, residual, kernels, copy_to=sink)
    if isinstance(keep_input, list):
        keep_input.append(residual)  # (add_forward returns a new tensor: nothing writes to it later)
    h, residual = layer.post_attention_layernorm.add_forward(attend(h), residual, kernels)
    return layer.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # an uninitialized weight (build_model loads or initializes it): nn.Embedding's own init, on the
        # meta device build_model uses, imports torch._dynamo (about 90 MB resident)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class FusedKernelSwitch:
    """Which fused-kernel backend a model's layers call for their small ops: :mod:`gpu_kernels`
    (Triton, CUDA), :mod:`cpu_kernels` (C++, CPU) or none (torch ops). Mixed into the target and
    the drafter, which say where their layers and a device-telling weight are and how their
    projections get fused (``_kernel_layers``, ``_kernel_weight``, ``_ready_for_kernels``)."""

    kernels = None  # the backend module, or None
    fused_attention = False  # the backend's attention replaces SDPA (for the widths it handles)
    kernel_attention_prefill: bool | None = True  # ... in prefill forwards too (None: prompt chunks of up to
    # SHORT_PREFILL_TOKENS tokens a row; False: only in decode forwards)

    def use_fused_kernels(self, gpu: bool, cpu: bool, attention: bool | None = False, exact: bool = False) -> bool:
        """The Triton kernels where they run (``attention``: their paged attention too; None: for
        decode forwards and short prompt chunks; ``exact``: the exact backend), else the C++ ones where they run;
        returns whether either is on."""
        return self.use_gpu_kernels(gpu, attention, exact) or self.use_cpu_kernels(cpu)

    def use_gpu_kernels(self, enabled: bool = True, attention: bool | None = False, exact: bool = False) -> bool:
        """Switch the Triton kernels on where they can run (CUDA with Triton, a power-of-two
        head_dim); returns whether they are on. ``attention`` also swaps SDPA over gathered pages
        for the Triton paged attention (None: in decode forwards and prompt chunks of up to
        ``SHORT_PREFILL_TOKENS`` tokens a row; longer chunks keep SDPA). ``exact``:
        the exact backend (kernels/gpu/exact.py) in every forward, prefill included; an error where it
        cannot run."""
        head_dim = self.config.head_dim
        on = (enabled and gpu_kernels.usable_on(self._kernel_weight()) and head_dim & (head_dim - 1) == 0
              and self._ready_for_kernels())
        if exact:
            self._use_exact_kernels(on)
            return True
        self._set_kernels(gpu_fused if on else None, on and attention is not False and attention_kernel_fits(self.config))
        self.kernel_attention_prefill = attention
        return on

    def _use_exact_kernels(self, usable: bool) -> None:
        if not (usable and attention_kernel_fits(self.config)):
            raise ConfigError(
                "exact mode needs the Triton kernels on a CUDA device (gpu_kernels on, Triton installed) and a "
                f"power-of-two head_dim >= 16 (this model: {self.config.head_dim}); on the CPU the fp32 paths "
                "already give speculative tokens equal to plain ones")
        self._set_kernels(gpu_exact, True)
        self.kernel_attention_prefill = True

    def use_cpu_kernels(self, enabled: bool = True) -> bool:
        """Switch the C++ kernels on for an fp32 model on the CPU where their library builds,
        attention included (kernels/cpu/fused.py says which forwards); returns whether they are on."""
        on = enabled and cpu_fused.usable_on(self._kernel_weight()) and self._ready_for_kernels()
        self._set_kernels(cpu_fused if on else None, on)
        self.kernel_attention_prefill = True
        return on

    @property
    def fused_kernels(self) -> bool:
        return self.kernels is not None

    def uses_kernel_attention(self, new_tokens: int, prefill: bool = False) -> bool:
        """A forward of ``new_tokens`` per row (a prompt chunk's: ``prefill``) attends with the
        backend's kernel (it needs no mask, key range or gathered pages) rather than SDPA."""
        short = self.kernel_attention_prefill is None and new_tokens <= SHORT_PREFILL_TOKENS
        return (self.fused_attention and self.kernels.handles_attention(new_tokens, prefill)
                and (not prefill or self.kernel_attention_prefill is True or short))

    def _set_kernels(self, kernels, attention: bool) -> None:
        self.kernels, self.fused_attention = kernels, attention
        if getattr(self, "layer_stack", None) is not None:  # it calls the C++ kernels: rebuilt on request
            self.layer_stack = None
        for layer in self._kernel_layers():
            layer.self_attn.kernels = layer.mlp.kernels = kernels
            layer.self_attn.fused_attention = attention


def _stack_mlp(mlp: nn.Module) -> tuple | None:
    """A layer's MLP as :class:`LayerWeights` takes it, (gate_up, down, moe); None when its products are not
    all GGUF blocks on the C++ kernels (the stack cannot run it)."""
    if isinstance(mlp, SparseMoE):
        table = mlp.kernel_table()
        return None if table is None else (None, None, table)
    return None if None in (mlp.gate_up_quant, mlp.down_quant) else (mlp.gate_up_quant, mlp.down_quant, None)


class ForwardOutput(NamedTuple):
    logits: torch.Tensor  # [B, M, vocab] float32, at the requested positions (a packed batch: [1, T, vocab])
    hidden: torch.Tensor | None  # [B, N, len(capture_layers) * hidden], after those layers (None with a sink;
    # a packed batch: [1, T, ...])


class CausalLM(FusedKernelSwitch, nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryTable | None = None
        self.lm_head_quant: QuantizedLinear | None = None  # GGUF blocks (see MLP)
        self.embed_quant: QuantizedLinear | None = None  # the embedding's GGUF blocks (tied: lm_head_quant)
        self.layer_stack: LayerStack | None = None  # every layer in one C++ call (use_layer_stack)

    def fuse(self) -> None:
        """Fuse per-layer projections for inference (call after the weights are loaded)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def _kernel_layers(self):
        return self.model.layers

    def hold_float32_products(self, on: bool = True) -> bool:
        """Every product that holds no GGUF blocks (a dense float32 CPU model's, an F16 GGUF's) runs the block
        kernel over its float32 weight (``quant_linear.float32_rows``, no copy), as the blocks' products do: a
        row's result then never depends on how many rows share the forward (F.linear's does: MKL picks its
        kernels by shape), so a tree node gets plain decoding's bits in every CPU model (a MoE layer's experts
        too, where the kernel takes both their products: they then run in the layer's one C++ call). Off, those
        holders go (GGUF ones stay). Returns whether any product is held so; call :meth:`use_layer_stack` after."""
        head = self.lm_head.weight
        if on and (head.device.type != "cpu" or head.dtype != torch.float32 or self.kernels not in (None, cpu_fused)):
            on = False  # (the Triton backends, also run by the interpreter on CPU tensors, take no blocks)
        if on:
            try:
                load_kernels()
            except KernelUnavailable:
                on = False
        for owner, attr, weight in self._dense_products():
            held = getattr(owner, attr)
            if on and held is None:
                setattr(owner, attr, float32_rows(weight))
            elif not on and isinstance(held, Float32Rows):
                setattr(owner, attr, None)
        return any(isinstance(getattr(owner, attr), Float32Rows) for owner, attr, _ in self._dense_products())

    def _dense_products(self):
        """(module, holder attribute, float32 weight) of every product of the layers and the LM head."""
        for layer in self._kernel_layers():
            attn, mlp = layer.self_attn, layer.mlp
            yield attn, "qkv_quant", attn.qkv_weight
            yield attn, "o_quant", attn.o_proj.weight
            if not isinstance(mlp, SparseMoE):
                yield mlp, "gate_up_quant", mlp.gate_up
                yield mlp, "down_quant", mlp.down_proj.weight
            elif all(map(float32_rows_fit, (mlp.experts[0].gate_up, mlp.experts[0].down_proj.weight))):
                for expert in mlp.experts:  # both products or neither: the one-call C++ path takes both holders
                    yield expert, "gate_up_quant", expert.gate_up
                    yield expert, "down_quant", expert.down_proj.weight
        yield self, "lm_head_quant", self.lm_head.weight

    def _kernel_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def _ready_for_kernels(self) -> bool:
        """fuse() ran (the kernels read the fused qkv and gate-up outputs)."""
        return all(layer.self_attn.qkv_weight is not None and layer.mlp.fused for layer in self.model.layers)

    def use_layer_stack(self, enabled: bool = True) -> bool:
        """Run the decoder layers of CPU forwards that attend with the C++ attention in one call into the kernel
        library (``kernels/cpu/layer_stack.py``; the same values as layer by layer) where every layer
        can: the C++ kernels on, every linear with GGUF blocks (a MoE layer's experts too). Returns whether
        it is on. Call it again after the kernels or the blocks change."""
        self.layer_stack = None
        layers = self.model.layers
        if not enabled or self.kernels is not cpu_fused:
            return False
        mlps = [_stack_mlp(layer.mlp) for layer in layers]
        if None in mlps or not all(None not in (layer.self_attn.qkv_quant, layer.self_attn.o_quant)
                                   for layer in layers):
            return False
        attn = layers[0].self_attn
        cfg = self.config
        dims = LayerDims(cfg.hidden_size, attn.heads, attn.kv_heads, attn.head_dim, cfg.intermediate_size,
                         cfg.rms_norm_eps, attn.q_norm.eps if attn.q_norm is not None else 0.0)
        self.layer_stack = LayerStack([LayerWeights(
            layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
            layer.self_attn.qk_norm_weight, layer.self_attn.qkv_bias, layer.self_attn.qkv_quant,
            layer.self_attn.o_quant, *mlp) for layer, mlp in zip(layers, mlps)], dims)
        return True

    def setup_rope(self, max_positions: int) -> None:
        p = self.lm_head.weight
        self.rope = RotaryTable(self.config.head_dim, self.config.rope_theta, self.config.rope_scaling,
                                max_positions, p.device, p.dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, logits_index: torch.Tensor | None = None,
                capture_layers: Sequence[int] = (), feature_sink: FeatureSink | None = None) -> ForwardOutput:
        """Run the new tokens; ``logits_index [B, M]`` picks positions for the lm_head (all when None);
        ``capture_layers`` are decoder-layer ids whose outputs are returned (HF ``hidden_states[id+1]``),
        side by side, or written into ``feature_sink`` (then ``hidden`` is None)."""
        with prompt_chunk(batch.prefill):
            return self._forward(batch, cache, logits_index, capture_layers, feature_sink)

    def _forward(self, batch: ForwardBatch, cache: KVCache, logits_index: torch.Tensor | None,
                 capture_layers: Sequence[int], feature_sink: FeatureSink | None) -> ForwardOutput:
        if self.rope is None:
            self.setup_rope(self.config.max_position_embeddings)
        self.rope.ensure(int(batch.kv_len) + 1)
        packing = batch.packing
        if packing is not None and logits_index is not None:
            raise ValueError("a packed forward scores every packed token: logits_index must be None")
        ids = batch.input_ids if packing is None else packing.gather(batch.input_ids)[None]  # [B, N] or [1, T]
        x = self.input_embedding(ids)  # [B, N, hidden] (packed: [1, T, hidden], and so on below)
        # fused kernels look positions up in the tables; otherwise cos, sin [B, 1, N, head_dim]
        rope = (self.rope.cos, self.rope.sin) if self.kernels is not None else self.rope.lookup(batch.positions)
        if self.uses_kernel_attention(batch.num_new, batch.prefill):
            mask = None
            if self.kernels.EXACT:
                causal = batch.prefill or batch.chain
                batch = batch._replace(key_order=self.kernels.key_order(batch.new_mask, causal=causal))
        else:
            mask = attention_bias(attention_mask(batch), x.dtype)  # [B, 1, N, kv_len]
        write_index = cache.write_index(batch.slots, batch.cache_lengths, batch.num_new)
        captured = {}
        keepers = self._keepers(capture_layers, feature_sink)
        last = len(self.model.layers) - 1
        if mask is None and self.layer_stack is not None:  # (the C++ attention: the stack takes it all)
            x, residual = self._run_layer_stack(x, batch, cache, write_index, keepers, captured)
        else:
            residual = None
            for i, layer in enumerate(self.model.layers):
                kept = keepers.get(i - 1)  # layer i - 1's output (HF hidden_states[i]) is layer i's input
                x, residual = layer(x, residual, batch, cache, rope, mask, write_index, self.kernels, kept)
                if isinstance(kept, list):
                    captured[i - 1] = kept[0]
        x = residual + x  # [B, N, hidden], the last layer's output
        if last in keepers:  # HF takes the last one after the final norm
            final = self.final_norm(x)
            if feature_sink is None:
                captured[last] = final
            else:
                keepers[last].write(final)
        hidden = torch.cat([captured[i] for i in capture_layers], dim=-1) if captured else None
        if logits_index is not None:
            x = x.gather(1, logits_index[:, :, None].expand(-1, -1, x.shape[-1]))  # [B, M, hidden]
        return ForwardOutput(logits=self.output_logits(self.final_norm(x)), hidden=hidden)

    def _run_layer_stack(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                         write_index: tuple[torch.Tensor, torch.Tensor], keepers: dict,
                         captured: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer loop of :meth:`forward` in one kernel call: (last MLP output, residual). The
        kernel writes a sink's layers straight into its rows; other captures come back in ``captured``."""
        residual = x.clone()  # [B, N, hidden] ([1, T, hidden] packed); the kernel updates it layer by layer
        h = self.model.layers[0].input_layernorm(x)
        inner = {i + 1: kept for i, kept in keepers.items() if i + 1 < len(self.model.layers)}  # layer l's input
        # is layer l - 1's output
        direct = [kept for kept in inner.values() if isinstance(kept, SinkSegment) and kept.columns.dtype == x.dtype]
        if direct and len(direct) == len(inner):  # (a float32 sink: every captured layer straight into its rows)
            inputs, sink_rows = {layer: kept.columns for layer, kept in inner.items()}, direct[0].rows  # [R, hidden]
        else:
            inputs, sink_rows = {layer: x.new_empty(x.shape[0] * x.shape[1], x.shape[2]) for layer in inner}, None
        out = self.layer_stack(h, residual, inputs, (self.rope.cos, self.rope.sin), batch.positions, write_index,
                               cache.storage, cache.block_table, batch.slots, batch.cache_lengths, batch.new_mask,
                               capture_rows=sink_rows, packing=batch.packing)
        if sink_rows is None:
            for layer, kept in inputs.items():  # [B * N, hidden] each
                if isinstance(inner[layer], SinkSegment):
                    inner[layer].write(kept)
                else:
                    captured[layer - 1] = kept.view_as(x)
        return out, residual

    def _keepers(self, capture_layers: Sequence[int], sink: FeatureSink | None) -> dict:
        """Layer id -> where its output goes: a list to append it to, or the sink's segment."""
        if sink is None:
            return {layer: [] for layer in capture_layers}
        width = self.config.hidden_size
        return {layer: sink.segment(k, width) for k, layer in enumerate(capture_layers)}

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[...]`` -> embeddings ``[..., hidden]`` (from the GGUF blocks where the model holds them)."""
        return embedding(token_ids, self.model.embed_tokens.weight, self.embed_quant)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head on already-normed hidden states, float32 logits (the drafter's training uses the target's head)."""
        return self._head_product(hidden).float()

    def draft_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head as a drafter's proposals take it: on CUDA the logits in the product's dtype (16-bit for a
        bf16 / fp16 model: the tree build's exact radix top-k reads them as they are, with no float32 copy of
        every logit; the values are those of :meth:`head`), float32 elsewhere."""
        logits = self._head_product(hidden)
        return logits if logits.is_cuda else logits.float()

    def _head_product(self, hidden: torch.Tensor) -> torch.Tensor:
        return product(self.kernels)(hidden, self.lm_head.weight, None, self.lm_head_quant)  # [..., V]

    # the forward's own embedding and head; a tensor-parallel shard's look up and score its slice of the
    # vocabulary (models/parallel.py), while embed and head stay the whole vocabulary's (the drafter's)
    input_embedding = embed
    output_logits = head

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.model.norm
        return norm(x) if self.kernels is None else self.kernels.rms_norm(x, norm.weight, norm.eps)
