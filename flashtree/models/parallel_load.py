"""Build one rank's :class:`~flashtree.models.parallel.ShardedCausalLM` from the whole checkpoint.

Every rank reads the checkpoint (or draws the random weights) whole, one tensor at a time, and keeps
only its piece on its device, so a rank's device memory holds its shard (rank 0 also the whole
embedding and LM head, which its drafter reads). Random weights are drawn tensor by tensor in the
single-process model's order with its generator (``build.init_random_weights``), so every world
size shards the same model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from flashtree.config import EngineConfig
from flashtree.errors import CheckpointError
from flashtree.models.build import LoadedTarget
from flashtree.models.collectives import Collectives
from flashtree.models.config import ModelConfig
from flashtree.models.fp8 import dequantized
from flashtree.models.loader import load_checkpoint
from flashtree.models.moe import per_expert_weights
from flashtree.models.parallel import (
    EMBED,
    HEAD,
    ShardedCausalLM,
    attach_vocab_rows,
    shard_tensor,
)
from flashtree.models.quantized_weights import release_weights
from flashtree.models.transformer import CausalLM


def load_target_shard(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                      collectives: Collectives) -> LoadedTarget:
    """This rank's shard of ``config.target`` on ``device`` in ``dtype``, with the kernels
    ``config.kernels`` allows (the same choice on every rank). GGUF blocks are not kept: the shard
    holds its matrices in ``dtype``."""
    target, kernels = config.target, config.kernels
    checkpoint = load_checkpoint(target.model, random_weights=target.random_weights)
    model = build_shard(checkpoint.config, checkpoint.weights, device, dtype, collectives, seed=target.seed)
    model.use_fused_kernels(kernels.gpu_kernels, kernels.cpu_kernels, attention=kernels.triton_attention,
                            exact=kernels.exact)
    return LoadedTarget(model, checkpoint.tokenizer)


def build_shard(config: ModelConfig, weights: dict[str, torch.Tensor] | None, device: torch.device,
                dtype: torch.dtype, collectives: Collectives, seed: int = 0) -> ShardedCausalLM:
    """The shard of rank ``collectives.rank`` of the model ``config`` with the whole checkpoint
    ``weights`` (HF names; None: the random weights ``build_model`` draws with ``seed``)."""
    with torch.device("meta"):
        model = ShardedCausalLM(config, collectives)
        shapes = {name: tuple(p.shape) for name, p in CausalLM(config).named_parameters()}  # the whole model's
    keeps_vocab = collectives.rank == 0  # (the drafter's embedding and head)
    if not keeps_vocab:
        release_weights(model, [EMBED] if config.tie_word_embeddings else [EMBED, HEAD])
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    source = _random_tensors(shapes, device, dtype, seed) if weights is None else _checkpoint_tensors(shapes, weights, dtype)
    rows = slice(model.vocab_first, model.vocab_end)
    vocab = {}  # a worker's vocabulary rows (it holds no whole embedding or head)
    for name, whole in source:
        if params[name].numel():
            params[name].data.copy_(shard_tensor(name, whole, collectives.rank, collectives.world_size))
        elif name in (EMBED, HEAD):
            vocab[name] = whole[rows].to(device, copy=True)
    if keeps_vocab:
        attach_vocab_rows(model, model.model.embed_tokens.weight[rows], model.lm_head.weight[rows])
    else:
        attach_vocab_rows(model, vocab[EMBED], vocab.get(HEAD, vocab[EMBED]))
    model.eval().requires_grad_(False)
    model.fuse()
    model.reduce_row_parallel_outputs()
    return model


def _checkpoint_tensors(shapes: Mapping[str, tuple[int, ...]], weights: dict[str, torch.Tensor], dtype: torch.dtype
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor in ``dtype``) for every parameter of the whole model, from the checkpoint."""
    weights = per_expert_weights(weights)
    missing = sorted(set(shapes) - set(weights))
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {list(weights[name].shape)}, the config implies {list(shape)}")
        yield name, dequantized(name, weights, dtype)


def _random_tensors(shapes: Mapping[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype, seed: int
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of the random weights ``build.init_random_weights`` gives the whole model:
    the same draws, in the same order, from the same generator on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in shapes.items():
        tensor = torch.empty(shape, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, 0.02, generator=gen)
        yield name, tensor
