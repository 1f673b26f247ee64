"""The exact mode's attention on small shapes: under ``TRITON_INTERPRET=1`` on the CPU in float32
(tests/integration/test_exact_attention.py) and on CUDA in float32 and bfloat16 (tests/gpu/test_exact_mode.py).
:func:`check` returns, per dtype, whether

- every node of a draft tree gets bit for bit what a plain step gets at its position (the same committed
  entries and its ancestors laid out one after another, one new token),
- a row's result is the same alone and beside other rows of other lengths, and the first tokens of a causal
  chain get the same whatever the chain's length (prompt chunking, DFlash blocks),
- the splits give the same whether each runs in a program of its own or one program runs them all,
- (on CUDA, 16-bit dtypes) every number of new tokens per program gives the same,
- the values are softmax attention's (float64 reference) up to rounding, with contexts across split
  boundaries (512 logical keys per split);

run as a module it prints that as one JSON line."""

from __future__ import annotations

import json

import torch

from flashtree.kernels.gpu.exact_attention import ancestor_order, exact_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE, PAGES_PER_SLOT = 6, 2, 16, 16, 80  # 1,280 entries per slot: two key splits
TOKENS_PER_PROGRAM = (4, 8)  # the tile sizes compared on CUDA (16 and 32 rows: exact_attention.MAX_TILE_ROWS)
# a draft tree of 7 nodes: parents before children (node 0 is the root)
PARENTS = (-1, 0, 0, 1, 1, 2, 3)


class PagedCache:
    """A paged K/V cache for one layer with shuffled pages, one block table row per slot."""

    def __init__(self, slots: int, gen: torch.Generator, device: str, dtype: torch.dtype):
        pages = slots * PAGES_PER_SLOT
        self.k = torch.zeros(pages, KV_HEADS, PAGE, HEAD_DIM, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.table = torch.randperm(pages, generator=gen).view(slots, PAGES_PER_SLOT).to(device)

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Entries ``0 .. L-1`` of ``slot`` := keys / values ``[L, KVH, D]``."""
        for position in range(keys.shape[0]):
            page = self.table[slot, position // PAGE]
            self.k[page, :, position % PAGE] = keys[position]
            self.v[page, :, position % PAGE] = values[position]


def tree_mask(parents=PARENTS) -> torch.Tensor:
    """``[N, N]`` bool: node i sees itself and its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            mask[node, parent] = True
            parent = parents[parent]
    return mask


def _attend(cache: PagedCache, q: torch.Tensor, slots: list[int], lengths: list[int], mask: torch.Tensor | None,
            parallel: bool | None = None, tokens: int | None = None):
    device = q.device
    order = None if mask is None else ancestor_order(mask.to(device))
    return exact_attention(q, cache.k, cache.v, cache.table, torch.tensor(slots, device=device),
                           torch.tensor(lengths, device=device), order, parallel=parallel, tokens=tokens)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q ``[H, D]`` over keys/values ``[L, KVH, D]`` in float64 -> ``[H, D]``."""
    group = HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    weights = torch.softmax((k @ q.double()[:, :, None]).squeeze(-1) * HEAD_DIM ** -0.5, dim=-1)  # [H, L]
    return (weights[:, None, :] @ v).squeeze(1)


def _tree_checks(gen, device, dtype) -> tuple[bool, bool, bool, float]:
    committed, n = 1100, len(PARENTS)  # 1,100 committed entries: a node's keys cross the split boundary
    mask = tree_mask()
    cache = PagedCache(1 + n, gen, device, dtype)
    keys = torch.randn(committed + n, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    values = torch.randn(committed + n, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    cache.write(0, keys, values)
    q = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen).to(device, dtype)
    tree = _attend(cache, q, [0], [committed], mask[None], parallel=False)  # [1, H, N, D]
    paths_agree = torch.equal(_attend(cache, q, [0], [committed], mask[None], parallel=True), tree)
    # the interpreter's tl.dot rounds by its shape, and so do float32 (non-tensor-core) products on the device
    tiles = TOKENS_PER_PROGRAM if device != "cpu" and dtype != torch.float32 else ()
    tiles_agree = all(torch.equal(_attend(cache, q, [0], [committed], mask[None], parallel=parallel, tokens=tokens),
                                  tree) for tokens in tiles for parallel in (False, True))
    identical, worst = True, 0.0
    for node in range(n):
        path = [committed + j for j in torch.nonzero(mask[node]).flatten().tolist()]  # ancestors, then itself
        logical = list(range(committed)) + path
        cache.write(1 + node, keys[logical], values[logical])
        plain = _attend(cache, q[:, :, node:node + 1].contiguous(), [1 + node], [len(logical) - 1], None,
                        parallel=True)
        identical &= torch.equal(plain[0, :, 0], tree[0, :, node])
        ref = _reference(q[0, :, node], keys[logical], values[logical])
        worst = max(worst, (tree[0, :, node].double() - ref).abs().max().item())
    return identical, paths_agree, tiles_agree, worst


def _batch_and_chunk_checks(gen, device, dtype) -> bool:
    lengths, n = [40, 700, 1030], 5
    cache = PagedCache(len(lengths), gen, device, dtype)
    for slot, length in enumerate(lengths):
        cache.write(slot, torch.randn(length + n, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype),
                    torch.randn(length + n, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype))
    q = torch.randn(len(lengths), HEADS, n, HEAD_DIM, generator=gen).to(device, dtype)
    together = _attend(cache, q, [0, 1, 2], lengths, None)  # causal chains of 5
    alone = all(torch.equal(_attend(cache, q[r:r + 1], [r], [lengths[r]], None)[0], together[r]) for r in range(3))
    shorter = torch.equal(_attend(cache, q[:, :, :2].contiguous(), [0, 1, 2], lengths, None), together[:, :, :2])
    later = _attend(cache, q[:, :, 2:].contiguous(), [0, 1, 2], [x + 2 for x in lengths], None)  # the next chunk
    chunked = torch.equal(later, together[:, :, 2:])
    as_mask = torch.equal(_attend(cache, q, [0, 1, 2], lengths, torch.ones(n, n).tril().bool().expand(3, n, n)),
                          together)
    return alone and shorter and chunked and as_mask


def check(dtypes=(torch.float32,), device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(0)
    results = {}
    for dtype in dtypes:
        tree_identical, paths_agree, tiles_agree, worst = _tree_checks(gen, device, dtype)
        results[str(dtype)] = {"tree_equals_plain": tree_identical, "parallel_equals_sequential": paths_agree,
                               "every_tile_agrees": tiles_agree,
                               "max_abs_diff": worst,
                               "batch_and_chunk_invariant": _batch_and_chunk_checks(gen, device, dtype)}
    return results


def main() -> None:
    print(json.dumps(check()))


if __name__ == "__main__":
    main()
