"""One rank's shard of a tensor-parallel target (Megatron-style splits of the decoder's matrices).

With W ranks, rank r holds
- attention: query heads ``r*H/W ..`` and KV heads ``r*KVH/W ..`` (column-parallel fused q/k/v; its
  KV cache holds only those KV heads), and the matching input columns of ``o_proj`` (row-parallel:
  one all-reduce sums the ranks' partial outputs);
- dense MLP: rows ``r*I/W ..`` of gate and up (column-parallel fused gate-up) and those columns of
  ``down_proj`` (row-parallel: one all-reduce);
- vocabulary: rows ``r*S .. r*S + S - 1`` of the embedding and the LM head (``S = ceil(V/W)``): the
  lookup takes the ids in its slice (zeros for the others) and one all-reduce completes it; each rank
  scores its slice and rank 0 gathers the whole logits;
- everything else whole: norms, q/k norms, rotary tables, MoE experts and routers (replicated).

A shard is a :class:`CausalLM` of the per-rank config (:func:`shard_config`: heads, KV heads and MLP
width divided by W), so every layer, kernel and cache already has its shapes; the all-reduces are
forward hooks on the attention and MLP modules (the single-process model has none), and the
vocabulary split replaces the forward's ``input_embedding`` / ``output_logits``. Rank 0 also keeps
the whole embedding and LM head (its slices are views into them): the drafter runs on rank 0 alone
and borrows them through ``embed`` / ``head``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.nn.functional as F

from flashtree.errors import ConfigError
from flashtree.kernels.feature_sink import FeatureSink
from flashtree.kv.cache import KVCache
from flashtree.models.batch import ForwardBatch
from flashtree.models.collectives import Collectives
from flashtree.models.config import ModelConfig
from flashtree.models.transformer import MLP, CausalLM, ForwardOutput, product

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_LAYER = r"model\.layers\.\d+\."
# (pattern, dim, part): the tensor's ``dim`` is cut into W parts; ``part`` names the head / width count
# that sets each rank's piece (q heads, KV heads, MLP width)
_SPLITS = (
    (re.compile(_LAYER + r"self_attn\.q_proj\.(weight|bias)$"), 0, "heads"),
    (re.compile(_LAYER + r"self_attn\.[kv]_proj\.(weight|bias)$"), 0, "kv_heads"),
    (re.compile(_LAYER + r"self_attn\.o_proj\.weight$"), 1, "heads"),
    (re.compile(_LAYER + r"mlp\.(gate|up)_proj\.weight$"), 0, "mlp"),
    (re.compile(_LAYER + r"mlp\.down_proj\.weight$"), 1, "mlp"),
)


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: heads, KV heads and dense MLP width divided by ``world_size``
    (an error names what does not divide)."""
    if world_size == 1:
        return config
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world_size:
            raise ConfigError(f"--tensor-parallel-size {world_size} must divide the target's {name} ({value}); "
                              f"allowed: a divisor of {config.num_attention_heads} heads and "
                              f"{config.num_key_value_heads} KV heads")
    if vocab_rows(config.vocab_size, world_size - 1, world_size)[0] >= config.vocab_size:
        raise ConfigError(f"--tensor-parallel-size {world_size} leaves a rank no rows of the target's "
                          f"{config.vocab_size}-token vocabulary")
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // world_size,
                               num_key_value_heads=config.num_key_value_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size)


def vocab_rows(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(first, end, per_rank): rank ``rank``'s vocabulary rows ``first .. end - 1``; every rank's slice
    of the LM head is padded to ``per_rank`` rows so the gathered logits have one shape."""
    per_rank = -(-vocab_size // world_size)
    first = min(rank * per_rank, vocab_size)
    return first, min(first + per_rank, vocab_size), per_rank


def shard_tensor(name: str, tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s piece of the whole checkpoint tensor ``name`` (HF names; a view where it can be):
    the splits of the module docstring; replicated tensors whole. The vocabulary tensors go apart
    (:func:`vocab_rows`)."""
    for pattern, dim, _ in _SPLITS:
        if pattern.match(name):
            width = tensor.shape[dim] // world_size
            return tensor.narrow(dim, rank * width, width)
    return tensor


class ForwardMirror(Protocol):
    """Rank 0's link to the other ranks (engine/tp_executor.py)."""

    def forward(self, batch: ForwardBatch, logits_index: torch.Tensor | None) -> AbstractContextManager[None]:
        """Entered around rank 0's forward: first sends the forward's inputs to the other ranks (which
        run the same forward with them); a failure inside becomes a clear error when a rank is gone."""


class ShardedCausalLM(CausalLM):
    """One rank's shard of the target (see the module docstring). ``config`` is the shard's
    (:func:`shard_config`); ``full_config`` the checkpoint's."""

    def __init__(self, full_config: ModelConfig, collectives: Collectives):
        super().__init__(shard_config(full_config, collectives.world_size))
        self.full_config, self.collectives = full_config, collectives
        self.vocab_first, self.vocab_end, self.vocab_per_rank = vocab_rows(
            full_config.vocab_size, collectives.rank, collectives.world_size)
        self.embed_rows: torch.Tensor | None = None  # [end - first, hidden] this rank's embedding rows
        self.head_rows: torch.Tensor | None = None  # [per_rank, hidden] its LM head rows, zero-padded
        self.mirror: ForwardMirror | None = None  # rank 0's: the other ranks mirror each forward
        self._reductions: list = []

    def reduce_row_parallel_outputs(self) -> None:
        """Sum every attention's and dense MLP's partial output over the ranks (a forward hook each)."""
        for handle in self._reductions:
            handle.remove()
        reduce = self.collectives.all_reduce
        self._reductions = [module.register_forward_hook(lambda _module, _args, out: reduce(out))
                            for layer in self.model.layers
                            for module in (layer.self_attn, layer.mlp)
                            if module is layer.self_attn or isinstance(module, MLP)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, logits_index: torch.Tensor | None = None,
                capture_layers: Sequence[int] = (), feature_sink: FeatureSink | None = None) -> ForwardOutput:
        """:meth:`CausalLM.forward` on this shard; on rank 0 the other ranks run it too (their logits
        are their slices; rank 0's are the whole vocabulary's)."""
        mirrored = contextlib.nullcontext() if self.mirror is None else self.mirror.forward(batch, logits_index)
        with mirrored:
            return super().forward(batch, cache, logits_index, capture_layers, feature_sink)

    def input_embedding(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: this rank's rows for the ids in its slice, zeros for the others,
        summed over the ranks. ``token_ids [...]`` -> ``[..., hidden]``."""
        local = token_ids - self.vocab_first
        inside = (local >= 0) & (token_ids < self.vocab_end)
        rows = F.embedding(local.clamp(0, self.embed_rows.shape[0] - 1), self.embed_rows)
        return self.collectives.all_reduce(rows * inside[..., None].to(rows.dtype))

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel LM head: each rank scores its slice; rank 0 returns the gathered logits
        ``[..., vocab]`` float32, the other ranks their own slice."""
        local = product(self.kernels)(hidden, self.head_rows, None, None).float()  # [..., per_rank]
        parts = self.collectives.gather(local)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[..., :self.full_config.vocab_size]

    def use_layer_stack(self, enabled: bool = True) -> bool:
        """Never: the stack runs every layer in one call, with no all-reduce between them."""
        self.layer_stack = None
        return False


def attach_vocab_rows(model: ShardedCausalLM, embed_rows: torch.Tensor, head_rows: torch.Tensor) -> None:
    """Give ``model`` its rows ``vocab_first .. vocab_end - 1`` of the embedding and the LM head
    (``[rows, hidden]`` each; on rank 0 views into its whole weights). The head's are zero-padded to
    ``vocab_per_rank`` rows (rank 0 cuts the padding's logits off)."""
    missing = model.vocab_per_rank - head_rows.shape[0]
    if missing:
        head_rows = torch.cat([head_rows, head_rows.new_zeros(missing, head_rows.shape[1])])
    model.embed_rows, model.head_rows = embed_rows, head_rows
