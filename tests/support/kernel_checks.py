"""Comparisons of the fused kernels (the Triton ones of flashtree/kernels/gpu, the C++ ones of
flashtree/kernels/cpu) against the plain torch ops they replace; each returns the largest
differences by name, and ``_check`` holds them to a tolerance.

Each model check runs a tiny random model twice on identical inputs, fused and unfused: a causal
prefill, then a tree of new tokens for two rows of different lengths, and compares logits,
captured hidden states and every KV-cache entry written. Used by tests/gpu/test_fused_kernels.py
(in-process on CUDA), tests/unit/test_cpu_kernels.py (the C++ kernels), and run as
``python -m tests.support.kernel_checks WORKDIR`` under ``TRITON_INTERPRET=1`` on CPU tensors by
tests/integration/test_gpu_kernels.py (the interpreter must be chosen before Triton compiles
anything); it prints the differences as one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

from flashtree.kernels.gpu import attention as attention_kernels
from flashtree.kernels.gpu import tree as tree_kernels
from flashtree.models.batch import ForwardBatch, causal_mask
from tests.helpers import make_cache, ours_from_hf, tiny_hf_model

FAMILIES = ("qwen3_qknorm", "qwen2_bias", "llama_tied_rope3")
PARENTS = [-1, 0, 0, 1, 2, 2]  # a small tree: root, two children, grandchildren


def _tree_batch(starts: list[int], device: str) -> ForwardBatch:
    depth = [0]
    for p in PARENTS[1:]:
        depth.append(depth[p] + 1)
    ancestors = []
    for i, p in enumerate(PARENTS):
        ancestors.append({i} | (ancestors[p] if p >= 0 else set()))
    mask = torch.tensor([[j in ancestors[i] for j in range(len(PARENTS))] for i in range(len(PARENTS))])
    n = len(PARENTS)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (len(starts), n), generator=gen)
    start_t = torch.tensor(starts)
    return ForwardBatch(ids.to(device), (start_t[:, None] + torch.tensor(depth)).to(device),
                        torch.tensor([2, 0]).to(device), start_t.to(device), mask.expand(len(starts), -1, -1).to(device),
                        kv_len=max(starts) + n)


def _run(model, device: str) -> dict[str, torch.Tensor]:
    cache = make_cache(model)
    prompts = [[3, 14, 15, 92, 65, 35, 89], [79, 32, 38]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    counts = torch.tensor([len(p) for p in prompts])
    prefill = ForwardBatch(ids.to(device), torch.arange(width).expand(2, -1).to(device), torch.tensor([2, 0]).to(device),
                           torch.zeros(2, dtype=torch.long, device=device), causal_mask(counts, width).to(device),
                           kv_len=width)
    first = model(prefill, cache, capture_layers=(0, model.config.num_hidden_layers - 1))
    cache.advance(prefill.slots, counts.to(device))
    tree_batch = _tree_batch([len(p) for p in prompts], device)
    packed_logits, packed_hidden = _packed_tree(model, cache, tree_batch)  # (first: the tree then writes every
    tree = model(tree_batch, cache)  # entry of its own, so the cache compared below holds no unpacked entry)
    return {"prefill_logits": first.logits, "hidden": first.hidden, "tree_logits": tree.logits,
            "packed_tree_logits": packed_logits, "packed_tree_hidden": packed_hidden,
            "sink": _sink_step(model, cache, counts.to(device), device), "kv": cache.storage}


def _packed_tree(model, cache, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree with its rows packed (models/packing.py): all of row 0's entries, the first 4 of row 1's (leaves 4
    and 5 left out), into 11 flat tokens, one a pad; (logits, hidden) of the 10 real ones (a pad token's values
    depend on how each path treats unpacked entries, which nothing reads)."""
    from flashtree.models.packing import pack_rows

    counts = torch.tensor([len(PARENTS), 4], device=batch.slots.device)
    packing = pack_rows(counts, len(PARENTS), 11)
    out = model(batch._replace(packing=packing), cache, capture_layers=(0, model.config.num_hidden_layers - 1))
    real = packing.padded_of < batch.input_ids.numel()  # [T]
    return out.logits[0][real], out.hidden[0][real]


def _sink_step(model, cache, lengths: torch.Tensor, device: str) -> torch.Tensor:
    """One decode token per row whose captured layers (the last one too) go into a feature sink's
    scattered rows (the fused norm writes them); returns the sink's buffer."""
    from flashtree.kernels.feature_sink import FeatureSink

    capture = (0, model.config.num_hidden_layers - 1)
    buffer = torch.zeros(6, len(capture) * model.config.hidden_size, dtype=model.lm_head.weight.dtype, device=device)
    step = ForwardBatch(torch.tensor([[7], [11]], device=device), lengths[:, None], torch.tensor([2, 0]).to(device),
                        lengths, torch.ones(2, 1, 1, dtype=torch.bool, device=device), kv_len=int(lengths.max()) + 1)
    out = model(step, cache, capture_layers=capture, feature_sink=FeatureSink(buffer, torch.tensor([4, 1], device=device)))
    assert out.hidden is None
    return buffer


def compare(device: str, dtype: torch.dtype, backend: str = "gpu", families=FAMILIES) -> dict[str, float]:
    """Max abs difference (fused vs unfused) per family and output; ``backend`` "gpu" (Triton,
    with and without its attention), "exact" (the exact mode's backend) or "cpu" (the C++ kernels)."""
    diffs = {}
    for family in families:
        model = ours_from_hf(tiny_hf_model(family), device=device, dtype=dtype)
        assert not model.fused_kernels
        plain = _run(model, device)
        for attention in ((False, True) if backend == "gpu" else (True,) if backend == "exact" else (False,)):
            if backend == "exact":
                on = model.use_gpu_kernels(exact=True)
            else:
                on = model.use_gpu_kernels(attention=attention) if backend == "gpu" else model.use_cpu_kernels()
            assert on, "the fused kernels did not switch on"
            fused = _run(model, device)
            for name in plain:
                diffs[f"{family}/attention={attention}/{name}"] = (plain[name].float() - fused[name].float()).abs().max().item()
    return diffs


def compare_drafter(device: str, dtype: torch.dtype, workdir: str, backend: str = "gpu") -> dict[str, float]:
    """Max abs difference (fused vs unfused) of a DFlash drafter's context K/V (observe) and
    draft logits, for a tiny random qwen3 target + 2-layer drafter."""
    from flashtree.models.dflash import load_drafter
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(workdir, vocab=64, block_size=5, drafter_layers=2, tokenizer=False)
    target = ours_from_hf(pair.hf, device=device, dtype=dtype)
    outputs = []
    for fused in (False, True):
        drafter = load_drafter(str(pair.drafter), target, device=device, dtype=dtype)
        on = drafter.use_gpu_kernels(fused, attention=True) if backend == "gpu" else drafter.use_cpu_kernels(fused)
        assert on == fused
        cache = drafter.new_cache(max_slots=3, max_context=32, scratch=8)
        gen = torch.Generator().manual_seed(2)
        slots = torch.tensor([2, 0], device=device)
        features = torch.randn(2, 6, drafter.fc.in_features, generator=gen).to(device, dtype)
        drafter.observe(cache, slots, features, torch.tensor([6, 4], device=device),
                        torch.zeros(2, dtype=torch.long, device=device))
        logits = drafter.draft_logits(cache, slots, torch.tensor([7, 9], device=device),
                                      torch.tensor([6, 4], device=device), kv_len=11)
        outputs.append({"drafter_kv": cache.storage.clone(), "draft_logits": logits})
    return {f"drafter/{k}": (outputs[0][k].float() - outputs[1][k].float()).abs().max().item() for k in outputs[0]}


def paginate(cache: torch.Tensor, page_size: int, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous ``[slots, KVH, capacity, D]`` cache as pages ``[1 + pages, KVH, page_size, D]``:
    the slots' pages in turn go to pages ``1 + order`` (a permutation of ``0 .. pages - 1``; page 0,
    the null page, holds NaN), with the block table ``[slots, capacity / page_size]`` that maps them."""
    slots, heads, capacity, dim = cache.shape
    per_slot = capacity // page_size
    pages = torch.full((1 + slots * per_slot, heads, page_size, dim), float("nan"), dtype=cache.dtype,
                       device=cache.device)
    flat = cache.view(slots, heads, per_slot, page_size, dim).transpose(1, 2).reshape(-1, heads, page_size, dim)
    pages[1 + order.to(cache.device)] = flat
    return pages, (1 + order).view(slots, per_slot).to(cache.device)


# (key splits, launch tile) of the GPU tree attention checked: the default tile at 1-4 splits, then tiles wider
# and narrower than the query rows (one tile of 128 rows over 8 warps; 16-row tiles, 32 keys a step, no pipelining)
ATTENTION_LAUNCHES = ((1, None), (2, None), (4, None),
                      (2, attention_kernels.AttentionTile(128, 32, warps=8, stages=2)),
                      (1, attention_kernels.AttentionTile(16, 32, stages=1)))


def compare_attention(device: str, dtype: torch.dtype, backend: str = "gpu", heads: int = 8, kv_heads: int = 2,
                      head_dim: int = 16, new: int = 5) -> dict[str, float]:
    """tree_attention against SDPA over the gathered cache with the engine's mask: rows of
    different committed lengths (one empty), a random tree mask, a sliding window, 1-4 key splits,
    read through a block table of shuffled pages (one page per slot, and pages of 4 and 16); ``new``
    tokens a row, ``heads`` query heads over ``kv_heads`` of ``head_dim``."""
    from flashtree.kernels.cpu import fused as cpu_kernels
    from flashtree.models.batch import attention_mask

    gen = torch.Generator().manual_seed(0)
    slots_n, capacity, rows = 4, 300, 3
    k_cache, v_cache = (torch.randn(slots_n, kv_heads, capacity, head_dim, generator=gen).to(device, dtype)
                        for _ in range(2))
    slots, lengths = torch.tensor([2, 0, 3], device=device), torch.tensor([7, 130, 0], device=device)
    new_mask = ((torch.rand(rows, new, new, generator=gen) > 0.5) | torch.eye(new, dtype=torch.bool)).to(device)
    q = torch.randn(rows, heads, new, head_dim, generator=gen).to(device, dtype)
    kv_len = int(lengths.max()) + new
    batch = ForwardBatch(torch.zeros(rows, new, dtype=torch.long, device=device), torch.zeros_like(new_mask[:, 0]).long(),
                         slots, lengths, new_mask, kv_len)
    diffs = {}
    for window in (None, 4):
        mask = attention_mask(batch)
        if window:
            key = torch.arange(kv_len, device=device)
            mask = mask & (key[None, :] >= lengths[:, None] - window)[:, None, None, :]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k_cache[slots, :, :kv_len].float(), v_cache[slots, :, :kv_len].float(), attn_mask=mask,
            enable_gqa=True)
        for page_size in (capacity, 4, 20):
            order = torch.randperm(slots_n * capacity // page_size, generator=gen)
            (k_pages, table), (v_pages, _) = paginate(k_cache, page_size, order), paginate(v_cache, page_size, order)
            for splits, tile in (ATTENTION_LAUNCHES if backend == "gpu" else ((1, None),)):
                if backend == "gpu":
                    out = attention_kernels.tree_attention(q, k_pages, v_pages, table, slots, lengths, new_mask, window,
                                                           splits=splits, tile=tile)
                else:
                    out = cpu_kernels.tree_attention(q, k_pages, v_pages, table, slots, lengths, new_mask, window)
                key = f"attention/window={window}/page_size={page_size}/splits={splits}/tile={tile}"
                diffs[key] = (out.float() - ref).abs().max().item()
    if backend == "gpu":
        diffs |= _attention_with_counts(q, k_cache, v_cache, batch, gen)
    return diffs


def _attention_with_counts(q, k_cache, v_cache, batch: ForwardBatch, gen: torch.Generator) -> dict[str, float]:
    """tree_attention told each row's real new tokens (a packed forward's ``counts``; each real token sees real
    ones only) against SDPA at the real tokens; every other output finite."""
    from flashtree.models.batch import attention_mask

    rows, new = batch.input_ids.shape
    device = q.device
    counts = torch.tensor([new, 2, 0], device=device)[:rows]
    entry = torch.arange(new, device=device)
    real = entry[None, :] < counts[:, None]  # [B, N]
    clipped = (batch.new_mask & real[:, None, :]) | torch.eye(new, dtype=torch.bool, device=device)
    batch = batch._replace(new_mask=clipped)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k_cache[batch.slots, :, :batch.kv_len].float(), v_cache[batch.slots, :, :batch.kv_len].float(),
        attn_mask=attention_mask(batch), enable_gqa=True)  # [B, H, N, D]
    diffs = {}
    for page_size in (4, 20):
        order = torch.randperm(k_cache.shape[0] * k_cache.shape[2] // page_size, generator=gen)
        (k_pages, table), (v_pages, _) = paginate(k_cache, page_size, order), paginate(v_cache, page_size, order)
        for splits, tile in ATTENTION_LAUNCHES:
            out = attention_kernels.tree_attention(q, k_pages, v_pages, table, batch.slots, batch.cache_lengths,
                                                   clipped, splits=splits, tile=tile, counts=counts).float()
            key = f"attention_counts/page_size={page_size}/splits={splits}/tile={tile}"
            diffs[key] = (out - ref).abs()[real[:, None, :, None].expand_as(out)].max().item()
            diffs[key + "/finite"] = 0.0 if torch.isfinite(out).all() else float("inf")
    return diffs


def compare_engine(device: str, workdir: str) -> dict[str, float]:
    """The lossless contract with every fused kernel on (Triton attention and tree kernel too): greedy
    DDTree tokens, padded and in fixed packed rounds (``packed_verify=True``), equal plain greedy tokens
    (batch 3, rows of different lengths); returns the numbers of differing tokens (0 expected) and checks
    the kernels were on."""
    from flashtree import LLM, SamplingParams
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(workdir + "/engine", vocab=64, block_size=5, drafter_layers=2, tokenizer=False)
    prompts = [[3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4]]
    outputs = {}
    for label, spec, packed in (("plain", "none", None), ("ddtree", "ddtree", False), ("ddtree_packed", "ddtree", True)):
        llm = LLM(str(pair.target), spec=spec, draft=str(pair.drafter) if spec != "none" else None, budget=6,
                  device=device, triton_attention=True, triton_tree=True, adaptive_spec=False, max_running=4,
                  max_context=64, packed_verify=packed)
        assert llm.engine.model.fused_attention
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        outputs[label] = [o.token_ids for o in outs]
    return {f"engine/{label}_tokens_differing_from_plain": float(
        sum(a != b for x, y in zip(outputs[label], outputs["plain"]) for a, b in zip(x, y)))
        for label in ("ddtree", "ddtree_packed")}


def compare_tree(device: str, cases: int) -> dict[str, float]:
    """build_tree with the Triton tree kernels (kept lists, node selection) against the torch
    path: the number of differing trees (0 expected) over random float32 / tied / bf16 logits, a
    masked vocabulary, budgets above the vocabulary, and per-row budgets (on CUDA also budgets 128
    and 256, whose kept lists take the bisection path); of differing accept
    walks (Triton walk kernel against the torch walk) along target choices that go deep; and of
    kept lists that differ between the kept-list kernel's three threshold searches (sort, bisection,
    narrowed bisection and sort)."""
    import random

    from flashtree.speculative.tree import build as tree_module
    from flashtree.speculative.verify import accept_walk
    from tests.support.tree_reference import assert_same_tree, make_logits

    rng, differing, differing_walks, differing_thresholds = random.Random(0), 0, 0, 0
    for case in range(cases):
        kind = ("f32", "int6", "int2", "bf16")[case % 4]
        depth, vocab, rows = rng.randint(1, 8), rng.randint(5, 300), 3
        logits = make_logits(kind, rows, depth, vocab, case).to(device)
        if case % 5 == 4:
            logits[:, :, 7:] = float("-inf")  # most prefixes do not exist
        budget = rng.choice([1, depth, 3 * depth, 16, 40] + ([128, 256] if device == "cuda" else []))
        budgets = torch.tensor([budget, rng.randint(0, budget), 0], device=device)
        tree = tree_module.build_tree(logits, budgets, budget)
        try:
            assert_same_tree(tree_module.build_tree(logits, budgets, budget, kernel=True), tree)
        except AssertionError:
            differing += 1
        differing_thresholds += not same_kept_lists_every_way(logits, budget)
        for seed in range(2):
            choice = walk_choices(tree, seed)
            walks = [accept_walk(tree, choice, depth, kernel=kernel) for kernel in (True, False)]
            differing_walks += any(not torch.equal(a, b) for a, b in zip(*walks))
    return {"tree/differing_trees": float(differing), "tree/differing_walks": float(differing_walks),
            "tree/differing_kept_lists_by_threshold_search": float(differing_thresholds)}


def compare_top_tokens(device: str) -> dict[str, float]:
    """The drafter logits' top-k log-probs as the tree builds them (``tree._top_tokens``: for
    bf16 / fp16 the Triton radix select, for float32 torch.topk and the Triton log-normalizer)
    against torch's float32 sort and logsumexp: the largest log-prob difference, the number of
    differing ranked values, and for 16-bit logits the number of differing tokens against a stable
    sort (ties in token order). Logits span several vocabulary chunks; one depth has a chunk of
    -inf only, one has many ties, one keeps every token (k = V)."""
    from flashtree.speculative.tree import build as tree_module

    worst, differing, differing_tokens = 0.0, 0, 0
    for dtype, vocab, k in ((torch.float32, 9000, 50), (torch.bfloat16, 9000, 50), (torch.float16, 9000, 256),
                            (torch.bfloat16, 300, 300)):
        gen = torch.Generator().manual_seed(3)
        logits = (torch.randn(2, 3, vocab, generator=gen) * 4)
        logits[1, 2] = logits[1, 2].round()  # many ties
        logits = logits.to(device, dtype)
        logits[0, 1, 4096:8192] = float("-inf")  # the second chunk holds nothing
        logp, tokens = tree_module._top_tokens(logits, k)
        ref = logits.float()
        ranked = torch.sort(ref, dim=-1, descending=True, stable=True)
        worst = max(worst, (logp - (ranked.values[..., :k] - torch.logsumexp(ref, -1, keepdim=True))).abs().max().item())
        differing += int((ref.gather(-1, tokens) != ranked.values[..., :k]).sum())  # same values in rank order
        if dtype != torch.float32:
            differing_tokens += int((tokens != ranked.indices[..., :k]).sum())
    return {"top_tokens/log_prob_max_diff": worst, "top_tokens/differing_ranked_values": float(differing),
            "top_tokens/differing_tokens_16bit": float(differing_tokens)}


def compare_commit(device: str) -> dict[str, float]:
    """The KV commit kernel (tree_kernels.commit_entries) against the torch gather + scatter: the
    number of differing storage entries (0 expected) after committing random tree paths (kept
    indices increasing, each at or past its place, so entries land where others are read) for
    several rows, odd head counts and a padded path."""
    from flashtree.kv.cache import KVCache, KVCacheSpec

    differing = 0
    for heads, head_dim, rows, path in ((2, 16, 3, 5), (3, 8, 2, 7), (1, 32, 4, 1)):
        spec = KVCacheSpec(num_layers=2, max_slots=5, max_context=12, scratch=8, kv_heads=heads, head_dim=head_dim)
        gen = torch.Generator().manual_seed(heads * 7 + path)
        caches = [KVCache(spec, torch.float32, device) for _ in range(2)]
        start_values = torch.randint(0, 12, (rows,), generator=gen)
        for cache in caches:
            cache.storage.copy_(torch.randn(cache.storage.shape, generator=torch.Generator().manual_seed(1)))
        keep = torch.stack([torch.sort(torch.randperm(8, generator=gen)[:path]).values for _ in range(rows)])
        counts = torch.randint(1, path + 1, (rows,), generator=gen)
        slots = torch.randperm(5, generator=gen)[:rows]
        caches[1].commit_kernel = True
        for cache in caches:
            cache.commit(slots.to(device), start_values.to(device), keep.to(device), counts.to(device))
        differing += int((caches[0].storage != caches[1].storage).sum())
        differing += int((caches[0].lengths != caches[1].lengths).sum())
    return {"commit/differing_entries": float(differing)}


def same_kept_lists_every_way(logits: torch.Tensor, budget: int) -> bool:
    """The kept-list kernel finds each depth's threshold by sorting the prefilter list, by
    bisection, or by a narrowed bisection and a sort (chosen by the list's length): all must give
    the same kept lists."""
    from flashtree.speculative.tree import build as tree_module

    k = min(budget, logits.shape[2])
    top_logp, top_tokens = tree_module._top_tokens(logits, k)
    pairs = tree_module._prefilter_pairs(budget, k, logits.device)
    ways = [tree_kernels.expand_levels(top_logp, top_tokens, budget, *pairs, search=search)
            for search in tree_kernels.THRESHOLD_SEARCHES]
    return all(torch.equal(a, b) for way in ways[1:] for a, b in zip(way, ways[0]))


def walk_choices(tree, seed: int) -> torch.Tensor:
    """Target choices [R, N] that follow a random child of each node 3 times in 4 (else a token
    no child has), so walks go deep and also stop early."""
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, valid = (t.cpu() for t in (tree.tokens, tree.parents, tree.valid))
    choice = torch.full(tokens.shape, 10**6, dtype=torch.long)
    for r in range(tokens.shape[0]):
        children_of: dict[int, list[int]] = {}
        for c in range(1, tokens.shape[1]):
            if valid[r, c]:
                children_of.setdefault(int(parents[r, c]), []).append(c)
        for node in range(tokens.shape[1]):
            children = children_of.get(node, [])
            if children and torch.rand(1, generator=gen).item() < 0.75:
                choice[r, node] = tokens[r, children[torch.randint(len(children), (1,), generator=gen).item()]]
    return choice.to(tree.tokens.device)


def _check(diffs: dict[str, float], tolerance: float) -> None:
    worst = {k: v for k, v in diffs.items() if v > tolerance}
    assert not worst, f"fused kernels differ from torch ops by more than {tolerance}: {worst}"


if __name__ == "__main__":  # run by tests/integration/test_gpu_kernels.py, with TRITON_INTERPRET=1
    diffs = compare("cpu", torch.float32) | compare_drafter("cpu", torch.float32, sys.argv[1])
    diffs |= compare_attention("cpu", torch.float32) | compare_engine("cpu", sys.argv[1])
    print(json.dumps(diffs | compare_tree("cpu", cases=12) | compare_top_tokens("cpu") | compare_commit("cpu")))
