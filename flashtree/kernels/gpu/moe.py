"""The fused mixture-of-experts MLP on CUDA: routing, the grouped expert products and the sum, with
no host sync (so a MoE target's rounds replay as CUDA graphs).

:func:`fused_moe` runs six kernels (``triton_moe.py``), five for one token:

1. :func:`route`: each token's router logits, then a float32 softmax over the experts, its ``top_k``
   experts by rank (renormalized to sum 1 with ``normalize``), as ``SparseMoE.route`` chooses them;
2. :func:`sort_by_expert`: the token-expert *pairs* grouped by expert on the device (one program
   per expert, from the pair counts the routing programs write), each expert's group padded to a
   multiple of :data:`BLOCK_M`, inside a fixed bound (:func:`padded_length`) so the shapes depend
   only on the token count; a lone token's pairs (distinct experts) get a block each from the
   routing instead;
3. gate + up: one grouped product per block of BLOCK_M pairs of one expert against its rows of the
   stacked ``gate_up [E, 2I, H]``, then ``silu(gate) * up``;
4. down: the same against ``down [E, H, I]``, each pair's row scaled by its routing weight (float32);
5. each token's ``top_k`` rows added in rank order (no atomics) and rounded once to x's dtype.

A token's arithmetic does not depend on the other tokens of the call: one tile shape for every
token count, reductions in BLOCK_K steps from 0 up, float32 accumulation, the rank-order sum (its
result is bit-identical alone or in any batch); :data:`GATE_UP_TILES` and :data:`DOWN_TILES` only
spread the columns over programs. Blocks past the last expert's exit at once, so a
decode step reads only its experts' weights.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashtree.kernels.gpu import next_power_of_2 as _next_power_of_2

BLOCK_M, BLOCK_K = 16, 64  # every grouped product's rows per block and reduction step (a token's arithmetic)
ROUTE_BLOCK_M = 16  # tokens per routing program
ROUTER_BLOCK_E, ROUTER_BLOCK_K = 16, 256  # experts and the K chunk of a router-partials program
SELECT_WARPS = 4  # warps of a selecting program (one or two make it slower: gpu_moe.py --select-warps)
SUM_BLOCK = 1024  # columns per program of the rank-order sum
SORT_CHUNK = 1024  # pairs a grouping program reads at a time


class Tiles(NamedTuple):
    """How a grouped product spreads over programs; no choice of these changes a result."""

    block_n: int  # output columns per program (16 or more)
    warps: int
    stages: int  # software-pipelined K steps in flight


GATE_UP_TILES = Tiles(block_n=64, warps=4, stages=4)
DOWN_TILES = Tiles(block_n=64, warps=4, stages=4)


@functools.cache
def _kernels():
    from flashtree.kernels.gpu import triton_moe

    return triton_moe


class ExpertPlan(NamedTuple):
    """The pairs of one call grouped by expert (every tensor int32, on the device)."""

    sorted_pairs: torch.Tensor  # [S] pair index (token * top_k + rank) at each slot; padding slots unset
    block_experts: torch.Tensor  # [S // BLOCK_M] each block's expert, -1 past the last used block
    block_rows: torch.Tensor  # [S // BLOCK_M] real pairs in each block (its first rows)


def padded_length(pairs: int, experts: int) -> int:
    """Slots enough for ``pairs`` pairs over ``experts`` experts whatever the routing: each expert
    that gets any pair wastes at most BLOCK_M - 1 padding slots."""
    slots = pairs + min(pairs, experts) * (BLOCK_M - 1)
    return -(-slots // BLOCK_M) * BLOCK_M


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool,
          plan: ExpertPlan | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` float32, expert ids ``[T, k]`` int32, pair counts ``[programs, E_PAD]``)
    for tokens x ``[T, H]`` and router weight ``[E, H]``: the float32 softmax of the logits (rounded
    to x's dtype first), its ``top_k`` largest by rank (the lower id on a tie), renormalized to sum
    1 when ``normalize``; each selecting program's row of counts says how many of its tokens' pairs
    each expert got (:func:`sort_by_expert` adds them up). ``plan`` (one token only, ``top_k``
    blocks): filled with one block per pair, so no grouping is needed. Two kernels: the logits' K-chunk
    partials (programs over tokens x experts x chunks, so one token's router read is spread out), then
    their ordered sum and the selection."""
    t, hidden = x.shape
    experts = router.shape[0]
    e_pad = _experts_padded(experts)
    programs = -(-t // ROUTE_BLOCK_M)
    chunks = -(-hidden // ROUTER_BLOCK_K)
    partials = torch.empty(chunks, t, e_pad, dtype=torch.float32, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    counts = torch.empty(programs, e_pad, dtype=torch.int32, device=x.device)
    if plan is not None and (t != 1 or plan.block_experts.numel() != top_k):
        raise ValueError(f"route: a plan of one block per pair needs one token and {top_k} blocks, "
                         f"got {t} tokens and {plan.block_experts.numel()} blocks")
    if t:
        triton_moe = _kernels()
        triton_moe._router_partials_kernel[(programs, -(-experts // ROUTER_BLOCK_E), chunks)](
            x, router, partials, t, experts, hidden, x.stride(0), router.stride(0), E_PAD=e_pad,
            BLOCK_M=ROUTE_BLOCK_M, BLOCK_E=ROUTER_BLOCK_E, BLOCK_K=ROUTER_BLOCK_K, IEEE=x.dtype == torch.float32)
        triton_moe._select_experts_kernel[(programs,)](
            partials, x, weights, ids, counts, *(plan or (ids, ids, ids)), t, experts, chunks,
            TOP_K=top_k, TOP_K_PAD=_next_power_of_2(top_k), NORMALIZE=normalize, BLOCK_M=ROUTE_BLOCK_M,
            E_PAD=e_pad, PLAN_M=BLOCK_M, PAIR_BLOCKS=plan is not None, num_warps=SELECT_WARPS)
    return weights, ids, counts


def _empty_plan(slots: int, device: torch.device) -> ExpertPlan:
    blocks = slots // BLOCK_M
    return ExpertPlan(torch.empty(slots, dtype=torch.int32, device=device),
                      torch.empty(blocks, dtype=torch.int32, device=device),
                      torch.empty(blocks, dtype=torch.int32, device=device))


def sort_by_expert(ids: torch.Tensor, counts: torch.Tensor, experts: int) -> ExpertPlan:
    """Group the pairs of ``ids [T, k]`` by expert (experts in id order, an expert's pairs in pair
    order), each group padded to a multiple of BLOCK_M slots; ``counts``: :func:`route`'s. One
    program per expert, no host sync."""
    pairs = ids.numel()
    plan = _empty_plan(padded_length(pairs, experts), ids.device)
    e_pad = counts.shape[1]
    _kernels()._sort_by_expert_kernel[(experts,)](
        ids.contiguous(), counts, *plan, pairs, counts.shape[0], plan.block_experts.numel(),
        BLOCK_M=BLOCK_M, E_PAD=e_pad, GROUP_TILE=max(1, 4096 // e_pad), CHUNK=SORT_CHUNK)
    return plan


def _experts_padded(experts: int) -> int:
    return max(16, _next_power_of_2(experts))


def fused_moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
              normalize: bool) -> torch.Tensor:
    """The sparse MoE MLP of tokens x ``[T, H]``: router ``[E, H]``, gate_up ``[E, 2I, H]`` (each
    expert's gate rows, then its up rows), down ``[E, H, I]`` -> ``[T, H]`` in x's dtype."""
    t, hidden = x.shape
    experts, double_inter, _ = gate_up.shape
    inter = double_inter // 2
    if router.shape != (experts, hidden) or gate_up.shape[2] != hidden or down.shape != (experts, hidden, inter):
        raise ValueError(f"fused_moe: x [T, {hidden}], router {list(router.shape)}, gate_up {list(gate_up.shape)} "
                         f"and down {list(down.shape)} do not fit (router [E, H], gate_up [E, 2I, H], down [E, H, I])")
    if not (x.dtype == router.dtype == gate_up.dtype == down.dtype):
        raise ValueError(f"fused_moe: x, router, gate_up and down must share a dtype, got {x.dtype}, "
                         f"{router.dtype}, {gate_up.dtype}, {down.dtype}")
    x, router, gate_up, down = x.contiguous(), router.contiguous(), gate_up.contiguous(), down.contiguous()
    out = torch.empty_like(x)
    if t == 0:
        return out
    if t == 1:  # one token's experts are distinct: one block per pair, no grouping
        plan = _empty_plan(padded_length(top_k, experts), x.device)
        weights, ids, _ = route(x, router, top_k, normalize, plan)  # [1, k] each
    else:
        weights, ids, counts = route(x, router, top_k, normalize)  # [T, k] each
        plan = sort_by_expert(ids, counts, experts)
    blocks = plan.block_experts.numel()
    ieee = x.dtype == torch.float32
    triton_moe = _kernels()
    act = torch.empty(plan.sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)  # [S, I] by slot
    tiles = GATE_UP_TILES
    triton_moe._gate_up_kernel[(blocks, -(-inter // tiles.block_n))](
        x, gate_up, act, *plan, inter, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K, IEEE=ieee,
        num_warps=tiles.warps, num_stages=tiles.stages)
    pair_out = torch.empty(t * top_k, hidden, dtype=torch.float32, device=x.device)  # [T * k, H] by pair
    tiles = DOWN_TILES
    triton_moe._down_kernel[(blocks, -(-hidden // tiles.block_n))](
        act, down, weights, pair_out, *plan, hidden, inter, act.stride(0), down.stride(0), down.stride(1),
        pair_out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_K=BLOCK_K, IEEE=ieee,
        num_warps=tiles.warps, num_stages=tiles.stages)
    triton_moe._sum_pairs_kernel[(t, -(-hidden // SUM_BLOCK))](pair_out, out, hidden, TOP_K=top_k, BLOCK=SUM_BLOCK)
    return out
