"""DFlashDrafter: the z-lab DFlash block-diffusion drafter, and :func:`load_drafter`.

Semantics (the z-lab DFlash format):
1. context features of a committed token (target hidden states after ``target_layer_ids``,
   concatenated) -> ``fc`` -> ``hidden_norm``;
2. per drafter layer, the normed features go through ``k_proj`` / ``v_proj``, ``k_norm`` and RoPE
   at the token's absolute position: context K/V only (no query, no input norm, no MLP), kept
   in the drafter's own :class:`KVCache` and appended as tokens are committed (:meth:`observe`);
3. the block ``[bonus, MASK x (b-1)]``, embedded with the TARGET's embedding at positions
   ``start .. start+b-1``, runs pre-norm Qwen3 layers whose attention is non-causal over
   ``[context ; block]``; block K/V go to the cache's scratch entries and are never committed;
4. final ``norm``, then the TARGET's lm_head on slots 1..b-1: the draft logits.

Glossary
- context cache: the drafter's KV cache; entry j of a slot holds the context K/V of the
  committed token at absolute position j (its length equals the target's committed length).
- start: absolute position of the bonus token = the slot's committed length.
- b: block size; b-1 is the draft horizon.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

from flashtree.errors import CheckpointError, ConfigError
from flashtree.kernels.cpu import fused as cpu_kernels
from flashtree.kernels.cpu.quant_linear import QuantizedLinear, linear, quantize_q8_0
from flashtree.kv.cache import DEFAULT_PAGE_SIZE, KVCache, KVCacheSpec
from flashtree.kv.pages import PageTable
from flashtree.models.attention import attention_bias, masked_attention
from flashtree.models.batch import ForwardBatch, attention_mask
from flashtree.models.build import copy_weights, init_random_weights
from flashtree.models.dflash_config import DFlashConfig, parse_dflash_config
from flashtree.models.loader import hub_snapshot_dir, read_json, read_weights
from flashtree.models.rope import RotaryTable, apply_rotary
from flashtree.models.transformer import (
    MLP,
    CausalLM,
    FusedKernelSwitch,
    RMSNorm,
    fuse_attention_projections,
    prenorm_layer,
)

DRAFT_FORMS = ("a DFlash drafter directory (config.json + model.safetensors) or a Hugging Face hub id "
               "such as z-lab/Qwen3-8B-DFlash-b16")
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exports carry
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class TargetParts(NamedTuple):
    """What the drafter borrows from its target (kept out of the drafter's parameters)."""

    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids [B, N] -> [B, N, hidden]
    head: Callable[[torch.Tensor], torch.Tensor]  # normed hidden [B, N, hidden] -> float logits [B, N, V]
    draft_head: Callable[[torch.Tensor], torch.Tensor]  # the same logits for proposals (16-bit on a CUDA 16-bit target)


class DrafterAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm); its k/v projections also turn context features
    into context K/V."""

    def __init__(self, cfg: DFlashConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)  # z-lab: bias follows attention_bias
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # inference only (DFlashDrafter.fuse / use_*_kernels); training uses the modules above
        self.qkv_weight: torch.Tensor | None = None  # [(H + 2 KVH) * D, hidden]
        self.qkv_bias: torch.Tensor | None = None
        self.qk_norm_weight: torch.Tensor | None = None  # [2, D]: q_norm then k_norm
        self.kernels = None  # fused small-op backend (gpu_kernels / cpu_kernels), or None
        # CPU: Q8_0 blocks of qkv (and its k/v rows alone) and o_proj (DFlashDrafter.quantize_blocks)
        self.qkv_quant = self.kv_quant = self.o_quant = None
        self.fused_attention = False
        self.window = cfg.window(layer_index)  # sliding window (the Triton attention applies it itself)

    def fuse(self) -> None:
        fuse_attention_projections(self)

    def _fused_write(self, x: torch.Tensor, with_queries: bool, positions: torch.Tensor, cache: KVCache,
                     write_index: tuple[torch.Tensor, torch.Tensor], rope_tables) -> torch.Tensor:
        """Fused kernels: project (q,) k, v from ``x [B, N, hidden]``, norm and rotate, write K/V
        into the cache at ``write_index``; returns q ``[B, H, N, D]`` (empty without queries)."""
        skip = 0 if with_queries else self.heads * self.head_dim  # context tokens need no query
        bias = None if self.qkv_bias is None else self.qkv_bias[skip:]
        quant = self.kv_quant if skip else self.qkv_quant
        qkv = linear(x, self.qkv_weight[skip:], bias, quant)  # [B, N, (H? + 2 KVH) * D]
        return self.kernels.qkv_norm_rope_write(
            qkv, self.heads if with_queries else 0, self.kv_heads, self.qk_norm_weight, self.q_norm.eps,
            *rope_tables, positions, cache.k[self.layer_index], cache.v[self.layer_index], write_index)

    def key_value(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, N, hidden] -> K (normed, rotated) and V, each [B, KVH, N, D]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim)
        return apply_rotary(k.transpose(1, 2), *rope), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """Block attention: x [B, b, hidden]; block K/V go to the scratch entries of ``cache``."""
        b, n, _ = x.shape
        if self.kernels is not None:  # rope: the [P, D] cos/sin tables
            write_index = cache.write_index(batch.slots, batch.cache_lengths, n)
            q = self._fused_write(x, True, batch.positions, cache, write_index, rope)  # [B, H, b, D]
        else:
            q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim))
            q = apply_rotary(q.transpose(1, 2), *rope)  # [B, H, b, D]
            k, v = self.key_value(x, rope)  # [B, KVH, b, D] x2
            cache.write(self.layer_index, batch.slots, batch.cache_lengths, k, v)
        if mask is None:  # the backend's attention reads lengths and new_mask itself
            out = self.kernels.tree_attention(q, cache.k[self.layer_index], cache.v[self.layer_index],
                                              cache.block_table, batch.slots, batch.cache_lengths, batch.new_mask,
                                              window=self.window)
        else:
            keys, values = cache.view(self.layer_index, batch.slots, batch.kv_len)
            out = masked_attention(q, keys, values, mask)  # [B, H, b, D]
        return linear(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim), self.o_proj.weight,
                      self.o_proj.bias, self.o_quant)


class DrafterLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer (non-causal over context + block, by its mask)."""

    def __init__(self, cfg: DFlashConfig, layer_index: int):
        super().__init__()
        self.self_attn = DrafterAttention(cfg, layer_index)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache,
                rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor, kernels
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :func:`~flashtree.models.transformer.prenorm_layer`."""
        return prenorm_layer(self, x, residual, kernels, lambda h: self.self_attn(h, batch, cache, rope, mask))


class DFlashDrafter(FusedKernelSwitch, nn.Module):
    """Parameters carry the z-lab names: ``fc``, ``hidden_norm``, ``norm``, ``layers.i.*``."""

    KIND = "DFlash"  # in error messages
    OWN_TENSORS = "fc, hidden_norm, norm and layers.i.*"  # what its checkpoints hold

    def __init__(self, config: DFlashConfig, target: CausalLM):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.context_width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.target = TargetParts(embed=target.embed, head=target.head, draft_head=target.draft_head)
        self.rope: RotaryTable | None = None
        self.fc_quant = None  # CPU: Q8_0 blocks of fc (quantize_blocks)

    def fuse(self) -> None:
        """Fuse q/k/v and gate/up projections for inference (training keeps them apart)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def _kernel_layers(self):
        return self.layers

    def _kernel_weight(self) -> torch.Tensor:
        return self.fc.weight

    def _ready_for_kernels(self) -> bool:
        """Fuse the projections (inference only: training keeps them apart) when not done yet."""
        if self.layers and self.layers[0].self_attn.qkv_weight is None:
            self.fuse()
        return True

    def quantize_blocks(self) -> None:
        """CPU, with the C++ kernels on: round the drafter's matrices to Q8_0 once and keep the
        blocks, from which every product of the drafter is computed (a quarter of the bytes of fp32).
        The fp32 weights become the blocks' exact values (the torch-ops path and training read them).
        The drafter only proposes, so its rounding cannot change what is committed."""
        if self.kernels is not cpu_kernels:
            raise ValueError("quantize_blocks needs the CPU kernels on (use_cpu_kernels)")
        self.fc_quant = _round_to_blocks(self.fc.weight)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_quant = _round_to_blocks(attn.qkv_weight)  # q/k/v weights are views of it
            q_rows = attn.heads * attn.head_dim
            attn.kv_quant = QuantizedLinear("Q8_0", attn.qkv_quant.blocks[q_rows:], attn.qkv_quant.in_features)
            attn.o_quant = _round_to_blocks(attn.o_proj.weight)
            mlp.gate_up_quant, mlp.down_quant = _round_to_blocks(mlp.gate_up), _round_to_blocks(mlp.down_proj.weight)


    # ------------------------------------------------------------------ state
    def setup_rope(self, max_positions: int) -> None:
        p = self.fc.weight
        self.rope = RotaryTable(self.config.head_dim, self.config.rope_theta, self.config.rope_scaling,
                                max_positions, p.device, p.dtype)

    def new_cache(self, max_slots: int, max_context: int, scratch: int, pages: PageTable | None = None) -> KVCache:
        """A context cache for ``max_slots`` rows of ``max_context`` committed tokens; ``scratch``
        must cover the block and the widest :meth:`observe` (padded entries land there). ``pages``:
        block tables shared with the target's cache (None: the cache's own, fully mapped)."""
        cfg = self.config
        page_size = DEFAULT_PAGE_SIZE if pages is None else pages.page_size
        spec = KVCacheSpec(cfg.num_hidden_layers, max_slots, max_context, max(scratch, cfg.block_size),
                           cfg.num_key_value_heads, cfg.head_dim, page_size)
        cache = KVCache(spec, self.fc.weight.dtype, self.fc.weight.device, pages)
        if self.rope is None or self.rope.max_positions < spec.capacity + 1:
            self.setup_rope(spec.capacity + 1)
        return cache

    # ------------------------------------------------------------------ the two passes
    @torch.inference_mode()
    def observe(self, cache: KVCache, slots: torch.Tensor, features: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor) -> None:
        """Append the context K/V of newly committed tokens at their positions.

        slots, counts, starts: [B] (starts = the slot's context length so far); features:
        [B, P, context_width] for absolute positions ``starts[b] + j``, j < counts[b] (the rest
        is padding, written past the new length, which becomes ``starts + counts``).
        """
        width = features.shape[1]
        context = self.hidden_norm(linear(features.to(self.fc.weight.dtype), self.fc.weight, None,
                                          self.fc_quant))  # [B, P, hidden]
        positions = starts[:, None] + torch.arange(width, device=starts.device)  # [B, P]
        if self.kernels is not None:
            write_index = cache.write_index(slots, starts, width)
            for layer in self.layers:
                layer.self_attn._fused_write(context, False, positions, cache, write_index,
                                             (self.rope.cos, self.rope.sin))
        else:
            rope = self.rope.lookup(positions)  # cos, sin [B, 1, P, head_dim]
            for index, layer in enumerate(self.layers):
                k, v = layer.self_attn.key_value(context, rope)  # [B, KVH, P, D] x2
                cache.write(index, slots, starts, k, v)
        # Set, not incremented: the context length is starts + counts however often this runs
        # (a CUDA-graph capture runs a round once more as warm-up).
        cache.lengths[slots] = starts + counts

    @torch.inference_mode()
    def draft_logits(self, cache: KVCache, slots: torch.Tensor, bonus: torch.Tensor, starts: torch.Tensor,
                     kv_len: int, depth: int | None = None
                     ) -> torch.Tensor:
        """Draft logits ``[B, depth, V]`` (in ``TargetParts.draft_head``'s dtype) for the blocks
        ``[bonus, MASK x (b-1)]``: the first ``depth`` draft positions (default all b-1). The whole
        block runs through the layers (attention inside a block is non-causal); only the lm_head,
        the largest piece on a CPU, is cut to the positions a round can use.

        slots, bonus, starts: [B] (starts = each slot's context length); kv_len >= max(starts) + b.
        """
        depth = self.draft_depth(depth)
        x = self.block_hidden(cache, slots, bonus, starts, kv_len)  # [B, b, hidden]
        return self.target.draft_head(self.norm(x[:, 1:1 + depth]))  # [B, depth, V]

    def draft_depth(self, depth: int | None) -> int:
        """``depth`` checked against the draft horizon b-1 (None: all of it)."""
        horizon = self.config.block_size - 1
        depth = horizon if depth is None else depth
        if not 1 <= depth <= horizon:
            raise ValueError(f"depth must be in [1, {horizon}], got {depth}")
        return depth

    def block_hidden(self, cache: KVCache, slots: torch.Tensor, bonus: torch.Tensor, starts: torch.Tensor,
                     kv_len: int) -> torch.Tensor:
        """The blocks ``[bonus, MASK x (b-1)]`` through every layer: the last layer's output
        ``[B, b, hidden]``, before the final norm (arguments as in :meth:`draft_logits`)."""
        cfg = self.config
        num_rows, block = bonus.shape[0], cfg.block_size
        offsets = torch.arange(block, device=bonus.device)  # [b]
        block_ids = torch.where(offsets == 0, bonus[:, None], cfg.mask_token_id)  # [B, b]
        batch = ForwardBatch(
            input_ids=block_ids, positions=starts[:, None] + offsets, slots=slots, cache_lengths=starts,
            new_mask=torch.ones(num_rows, block, block, dtype=torch.bool, device=bonus.device),
            kv_len=kv_len)
        masks = {} if self.uses_kernel_attention(block) else self._layer_masks(batch)
        # fused kernels look positions up in the tables; otherwise cos, sin [B, 1, b, head_dim]
        rope = (self.rope.cos, self.rope.sin) if self.kernels is not None else self.rope.lookup(batch.positions)
        x = self.embed_block(block_ids)  # [B, b, hidden]
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch, cache, rope, masks.get(cfg.window(index)), self.kernels)
        return residual + x  # [B, b, hidden]

    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        """The block's input: the target's embedding of ``block_ids [B, b]`` -> ``[B, b, hidden]``."""
        return self.target.embed(block_ids).to(self.fc.weight.dtype)

    def _layer_masks(self, batch: ForwardBatch) -> dict[int | None, torch.Tensor]:
        """``[B, 1, b, kv_len]`` masks by window: all context + the whole block (non-causal); a
        sliding window keeps only the last ``window`` context positions."""
        full = attention_mask(batch)  # [B, 1, b, K]
        masks: dict[int | None, torch.Tensor] = {None: full}
        key = torch.arange(batch.kv_len, device=full.device)  # [K]
        for window in {self.config.window(i) for i in range(self.config.num_hidden_layers)} - {None}:
            recent = key[None, :] >= (batch.cache_lengths[:, None] - window)  # [B, K]
            masks[window] = full & recent[:, None, None, :]
        return {window: attention_bias(mask, self.fc.weight.dtype) for window, mask in masks.items()}


def _round_to_blocks(weight: torch.Tensor) -> QuantizedLinear:
    """Q8_0 blocks of ``weight``; the weight itself is overwritten with their values."""
    blocks = quantize_q8_0(weight)
    weight.data.copy_(blocks.dequantize())
    return blocks


# ---------------------------------------------------------------------------- loading

def load_drafter(path_or_hub_id: str, target: CausalLM, tokenizer=None, block_size_override: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 random_weights: bool = False, seed: int = 0) -> DFlashDrafter:
    """Load a z-lab DFlash drafter for ``target`` (a directory or a hub id), refusing a
    mismatched pair before anything runs. Device and dtype default to the target's;
    ``random_weights`` reads config.json alone (speed tests at real sizes)."""
    directory = resolve_drafter_dir(path_or_hub_id, need_weights=not random_weights)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(
            f"{directory}: config.json not found, so this is not a drafter; --draft accepts {DRAFT_FORMS}")
    raw = read_json(config_path, ConfigError)
    config = parse_dflash_config(raw, str(config_path), target.config, tokenizer, block_size_override)
    return build_drafter_from(directory, config, target, device, dtype, random_weights, seed)


def build_drafter_from(directory: Path, config: DFlashConfig, target: CausalLM, device: torch.device | str | None,
                       dtype: torch.dtype | None, random_weights: bool, seed: int,
                       drafter_class: type[DFlashDrafter] | None = None) -> DFlashDrafter:
    """The drafter of ``config`` with the weights in ``directory`` (random ones with ``random_weights``), on
    ``device`` in ``dtype`` (the target's by default)."""
    weights = None
    if not random_weights:
        weights = {name: t for name, t in read_weights(directory).items()
                   if not name.endswith(IGNORED_TENSOR_SUFFIXES)}
        check_fc_width(weights, config, directory)
    reference = target.lm_head.weight
    return build_drafter(config, target, weights, torch.device(device) if device else reference.device,
                         dtype or reference.dtype, seed=seed, drafter_class=drafter_class)


def resolve_drafter_dir(draft: str, *, need_weights: bool = True) -> Path:
    path = Path(draft).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise CheckpointError(f"{draft}: is a file, not a directory; --draft accepts {DRAFT_FORMS}")
    if _HUB_ID.match(draft):
        return hub_snapshot_dir(draft, need_weights=need_weights)
    raise CheckpointError(f"{draft}: no such directory; --draft accepts {DRAFT_FORMS}")


def check_fc_width(weights: dict[str, torch.Tensor], config: DFlashConfig, directory: Path) -> None:
    """``fc.weight [hidden, len(target_layer_ids) * hidden]`` must match the config."""
    fc = weights.get("fc.weight")
    if fc is None:
        raise CheckpointError(f"{directory}: the weights lack 'fc.weight', so this is not a DFlash drafter")
    expected = (config.hidden_size, config.context_width)
    if tuple(fc.shape) != expected:
        raise ConfigError(
            f"{directory}: 'fc.weight' has shape {list(fc.shape)}, but {config.source} implies {list(expected)} "
            f"(len(target_layer_ids) = {len(config.target_layer_ids)} x hidden_size = {config.hidden_size}); "
            f"allowed: fc width = {config.context_width}, one hidden vector per target layer id")


def build_drafter(config: DFlashConfig, target: CausalLM, weights: dict[str, torch.Tensor] | None,
                  device: torch.device, dtype: torch.dtype, seed: int = 0,
                  drafter_class: type[DFlashDrafter] | None = None) -> DFlashDrafter:
    """A drafter (``drafter_class``, :class:`DFlashDrafter` by default) on ``device`` in ``dtype``;
    ``weights=None`` means random weights."""
    drafter_class = drafter_class or DFlashDrafter
    with torch.device("meta"):
        drafter = drafter_class(config, target)
    drafter = drafter.to_empty(device=device).to(dtype)
    if weights is None:
        init_random_weights(drafter, seed)
    else:
        _load_weights(drafter, weights, config.source)
    return drafter.eval().requires_grad_(False)


def _load_weights(drafter: DFlashDrafter, weights: dict[str, torch.Tensor], source: str) -> None:
    expected = dict(drafter.named_parameters())
    kind = drafter.KIND
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(
            f"{kind} drafter weights beside {source} lack {len(missing)} tensor(s) the config implies, "
            f"e.g. {missing[:3]}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{kind} drafter weights beside {source} carry {len(unexpected)} tensor(s) a {kind} drafter does not "
            f"have, e.g. {unexpected[:3]}; allowed: {drafter.OWN_TENSORS} (the embedding and lm_head are the "
            f"target's)")
    copy_weights(expected, weights, source)
