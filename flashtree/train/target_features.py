"""The frozen target's part in training: context features for whole sequences.

The target runs once per batch, without grad, through the same :class:`CausalLM` forward the
engine uses (prefill of every row from position 0, causal), capturing the hidden states after
the ``target_layer_ids`` decoder layers. ``CausalLM.forward`` runs under inference mode, so the
features are cloned outside it before autograd sees them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.transformer import CausalLM


class TargetFeatures:
    """Context features of padded token batches; owns a scratch KV cache grown on demand."""

    def __init__(self, target: CausalLM, layer_ids: Sequence[int]):
        self.target = target
        self.layer_ids = tuple(layer_ids)
        self.cache: KVCache | None = None
        weight = target.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype

    def _ensure_cache(self, rows: int, width: int) -> KVCache:
        spec = self.cache.spec if self.cache is not None else None
        if spec is None or spec.max_slots < rows or spec.max_context < width:
            cfg = self.target.config
            rows = max(rows, spec.max_slots if spec else 0)
            width = max(width, spec.max_context if spec else 0)
            self.cache = None  # free the old one first
            self.cache = KVCache(KVCacheSpec(cfg.num_hidden_layers, rows, width, 1, cfg.num_key_value_heads,
                                             cfg.head_dim), self.dtype, self.device)
            self.target.setup_rope(width + 2)
        return self.cache

    def __call__(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids ``[B, N]``, lengths ``[B]`` (on the target's device) -> features
        ``[B, N, len(layer_ids) * hidden]``, a normal tensor (not an inference tensor)."""
        rows, width = input_ids.shape
        cache = self._ensure_cache(rows, width)
        zeros = torch.zeros(rows, dtype=torch.long, device=self.device)
        batch = ForwardBatch(
            input_ids=input_ids, positions=torch.arange(width, device=self.device).expand(rows, -1),
            slots=torch.arange(rows, device=self.device), cache_lengths=zeros,
            new_mask=causal_mask(lengths, width), kv_len=width)
        out = self.target(batch, cache, logits_index=zeros[:, None], capture_layers=self.layer_ids)
        return out.hidden.clone()
