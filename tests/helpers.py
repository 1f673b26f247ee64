"""Shared test fixtures: tiny random Hugging Face models and flashtree twins of them."""

from __future__ import annotations

import torch

from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.build import build_model
from flashtree.models.config import ModelConfig

TINY_FAMILIES = {
    "llama_gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama_tied_rope3": dict(
        model_type="llama", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2_bias": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3_qknorm": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3_moe": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1]),
}


def tiny_hf_config(family: str, vocab_size: int = 97, layers: int = 3, **overrides):
    import transformers

    extra = dict(TINY_FAMILIES[family]) | overrides
    model_type = extra.pop("model_type")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}[model_type]
    return cls(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
               max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, **extra)


def tiny_hf_model(family: str, seed: int = 0, vocab_size: int = 97, layers: int = 3, **overrides):
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(family, vocab_size, layers, **overrides),
                                                       dtype=torch.float32)
    with torch.no_grad():  # make the random model less flat so argmax decisions are meaningful
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif "norm" not in name:
                p.normal_(0, 0.1)
    return hf.eval()


def ours_from_hf(hf, device="cpu", dtype=torch.float32):
    config = ModelConfig.from_dict(hf.config.to_dict())
    return build_model(config, dict(hf.state_dict()), torch.device(device), dtype)


def make_cache(model, max_slots=4, max_context=128, scratch=64) -> KVCache:
    cfg = model.config
    spec = KVCacheSpec(cfg.num_hidden_layers, max_slots, max_context, scratch, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(spec, model.lm_head.weight.dtype, model.lm_head.weight.device)


def prefill_then_step(model, capture, sink=None):
    """Prefill two prompts (rows of different lengths), then one decode token per row capturing the
    layers ``capture`` (returned, or written into the feature ``sink``); the step's output."""
    cache = make_cache(model)
    prompts = [[3, 14, 15, 92, 65], [79, 32]]
    width = max(len(p) for p in prompts)
    counts = torch.tensor([len(p) for p in prompts])
    slots = torch.tensor([2, 0])
    prefill = ForwardBatch(torch.tensor([p + [0] * (width - len(p)) for p in prompts]),
                           torch.arange(width).expand(2, -1), slots, torch.zeros(2, dtype=torch.long),
                           causal_mask(counts, width), kv_len=width)
    model(prefill, cache)
    cache.advance(slots, counts)
    step = ForwardBatch(torch.tensor([[7], [11]]), counts[:, None], slots, counts,
                        torch.ones(2, 1, 1, dtype=torch.bool), kv_len=width + 1)
    return model(step, cache, capture_layers=capture, feature_sink=sink)


def random_tree(nodes: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestor mask ``[1, n, n]``, depth ``[n]``) of a random tree of ``nodes`` nodes, node 0 the root: node i
    sees itself and its ancestors."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
    ancestors: list[set[int]] = []
    for i, parent in enumerate(parents):
        ancestors.append({i} | (ancestors[parent] if parent >= 0 else set()))
    mask = torch.tensor([[j in ancestors[i] for j in range(nodes)] for i in range(nodes)])[None]
    return mask, torch.tensor([len(a) - 1 for a in ancestors])


def root_of_tree_and_plain_step(model, nodes: int, prompt_tokens: int, vocab: int, gen: torch.Generator
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill a random prompt of ``prompt_tokens`` into a fresh cache, then the logits ``[V]`` of the root of a
    verification forward of a random ``nodes``-node tree and of the plain decode step of the same token."""
    cache, slot = make_cache(model), torch.tensor([0])
    prompt = torch.randint(0, vocab, (1, prompt_tokens), generator=gen)  # [1, P]
    p = prompt_tokens
    model(ForwardBatch(prompt, torch.arange(p)[None], slot, torch.tensor([0]), causal_mask(torch.tensor([p]), p),
                       kv_len=p, prefill=True), cache)
    cache.advance(slot, torch.tensor([p]))
    mask, depth = random_tree(nodes, gen)
    ids = torch.randint(0, vocab, (1, nodes), generator=gen)  # [1, n]
    tree = model(ForwardBatch(ids, p + depth[None], slot, torch.tensor([p]), mask, kv_len=p + nodes), cache)
    step = model(ForwardBatch(ids[:, :1], torch.tensor([[p]]), slot, torch.tensor([p]),
                              torch.ones(1, 1, 1, dtype=torch.bool), kv_len=p + 1), cache)
    return tree.logits[0, 0], step.logits[0, 0]
