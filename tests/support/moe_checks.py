"""The fused MoE (flashtree/kernels/gpu/moe.py) against SparseMoE's reference path, on small shapes:
under ``TRITON_INTERPRET=1`` on the CPU in float32 (tests/integration/test_fused_moe_interpreter.py;
the interpreter has no bfloat16 arithmetic) and on CUDA in float32 and bfloat16
(tests/gpu/test_fused_moe.py). Run as a module it prints :func:`check` and :func:`model_check` for
float32 on the CPU as one JSON line.

:func:`check` builds SparseMoE layers (6-8 experts, top-2 or top-3, hidden 64, intermediate 32) and
returns per case and dtype:

- ``route_agreement``: the fraction of tokens whose experts (by rank) the fused routing and
  ``SparseMoE.route`` choose alike (1.0 in float32; bfloat16 logits may round a near tie apart);
- ``max_abs_diff``: the fused output against the reference path's, over the tokens routed alike;
- ``max_abs_diff_given_routing``: against float32 arithmetic on the same weights with the fused
  routing (what the kernels compute before their one rounding);
- ``tokens_invariant``: every token's output bit-identical alone, in a batch of 37, beside other
  tokens at other rows (tokens 5..11), and 37 copies of one token (one expert's pairs filling
  several blocks) equal to that token alone;
- ``route_counts_ok``: the routing programs' pair counts add up to each expert's pairs;
- ``plan_valid``: the expert grouping of random ids puts every pair once in a block of its expert;
- ``stacked_views``: after ``fuse()`` every expert parameter is a view into the stacked weights.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from flashtree.kernels.gpu import fused as gpu_fused
from flashtree.kernels.gpu import moe as moe_kernels
from flashtree.models.moe import SparseMoE, routes_on_host
from flashtree.models.transformer import MLP

HIDDEN, INTER = 64, 32
CASES = {"e8_top2_norm": (8, 2, True), "e6_top2": (6, 2, False), "e8_top3_norm": (8, 3, True)}
TOKENS = (1, 5, 37)


def make_moe(experts: int, top_k: int, normalize: bool, device: str, dtype: torch.dtype, seed: int = 0) -> SparseMoE:
    """A fused SparseMoE with random weights, on the fused kernels."""
    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoE(HIDDEN, INTER, experts, top_k, normalize, MLP)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    moe = moe.to(device, dtype).requires_grad_(False)
    moe.fuse()
    moe.kernels = gpu_fused
    return moe


def given_routing(moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 arithmetic on moe's weights for tokens x ``[T, H]`` routed to ``ids`` with ``weights``."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    gate_up, down = moe.gate_up.float(), moe.down.float()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            expert = int(ids[t, j])
            gate, up = (gate_up[expert] @ x[t].float()).chunk(2)
            out[t] += weights[t, j].float() * (down[expert] @ (F.silu(gate) * up))
    return out


def group_counts(ids: torch.Tensor, experts: int, group: int = 16) -> torch.Tensor:
    """``[groups, E_PAD]`` pair counts per expert of each ``group`` consecutive pairs (what the routing
    programs write)."""
    e_pad = moe_kernels._experts_padded(experts)
    chunks = ids.view(-1).long().split(group)
    return torch.stack([torch.bincount(chunk, minlength=e_pad) for chunk in chunks]).to(torch.int32)


def plan_valid(experts: int, pairs: int, device: str, seed: int = 3) -> bool:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (pairs,), generator=gen).to(torch.int32)
    ids[: pairs // 2] = 1  # one expert with many pairs (several blocks)
    counts = group_counts(ids, experts)
    plan = moe_kernels.sort_by_expert(ids.to(device).view(-1, 1), counts.to(device), experts)
    slots, block_experts, block_rows = (t.cpu() for t in plan)
    seen = []
    for block, (expert, rows) in enumerate(zip(block_experts.tolist(), block_rows.tolist())):
        if expert < 0:
            if rows:
                return False
            continue
        picked = slots[block * moe_kernels.BLOCK_M:block * moe_kernels.BLOCK_M + rows].tolist()
        if not 0 < rows <= moe_kernels.BLOCK_M or any(int(ids[p]) != expert for p in picked):
            return False
        seen += picked
    used = [e for e in block_experts.tolist() if e >= 0]
    return sorted(seen) == list(range(pairs)) and used == sorted(used) and block_experts[len(used):].eq(-1).all()


def stacked_views(moe: SparseMoE) -> bool:
    inter = moe.gate_up.shape[1] // 2
    for e, expert in enumerate(moe.experts):
        views = ((expert.gate_proj.weight, moe.gate_up[e, :inter]), (expert.up_proj.weight, moe.gate_up[e, inter:]),
                 (expert.down_proj.weight, moe.down[e]), (expert.gate_up, moe.gate_up[e]))
        for param, stacked in views:
            if param.data_ptr() != stacked.data_ptr() or param.untyped_storage().data_ptr() != \
                    stacked.untyped_storage().data_ptr():
                return False
    return True


def tokens_invariant(moe: SparseMoE, x: torch.Tensor) -> bool:
    full = moe(x)
    alone = torch.cat([moe(x[t:t + 1]) for t in range(x.shape[0])])
    copies = moe(x[3:4].expand(37, -1).contiguous())
    return (torch.equal(alone, full) and torch.equal(moe(x[5:12]), full[5:12])
            and torch.equal(copies, full[3:4].expand(37, -1)))


def tiles_invariant(device: str, dtype: torch.dtype) -> bool:
    """Other column tiles, warps and stages of the grouped products give the same bits (on CUDA; the
    interpreter's products are numpy's, whose blocking follows the tile's shape)."""
    moe = make_moe(8, 2, True, device, dtype)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    want = moe(x)
    defaults = moe_kernels.GATE_UP_TILES, moe_kernels.DOWN_TILES
    try:
        for tiles in (moe_kernels.Tiles(16, 2, 2), moe_kernels.Tiles(128, 8, 3)):
            moe_kernels.GATE_UP_TILES = moe_kernels.DOWN_TILES = tiles
            if not torch.equal(moe(x), want):
                return False
    finally:
        moe_kernels.GATE_UP_TILES, moe_kernels.DOWN_TILES = defaults
    return True


def router_chunks_agree(device: str) -> bool:
    """In float32, with the router's K in four chunks (16 wide, summed in order by the selection), the routing
    still matches the reference path's, and a token routes alike alone and among 37."""
    moe = make_moe(8, 3, True, device, torch.float32)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(6)).to(device)
    default = moe_kernels.ROUTER_BLOCK_K
    try:
        moe_kernels.ROUTER_BLOCK_K = 16
        weights, ids, _ = moe_kernels.route(x, moe.gate.weight, 3, True)
        alone = [moe_kernels.route(x[t:t + 1], moe.gate.weight, 3, True) for t in (0, 17, 36)]
    finally:
        moe_kernels.ROUTER_BLOCK_K = default
    ref_weights, ref_ids = moe.route(x)
    return (torch.equal(ids.long(), ref_ids) and (weights - ref_weights.float()).abs().max().item() < 1e-6
            and all(torch.equal(w, weights[t:t + 1]) and torch.equal(i, ids[t:t + 1])
                    for (w, i, _), t in zip(alone, (0, 17, 36))))


def check(dtypes=(torch.float32,), device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(1)
    results = {}
    for name, (experts, top_k, normalize) in CASES.items():
        for dtype in dtypes:
            moe = make_moe(experts, top_k, normalize, device, dtype)
            row = {"route_agreement": 1.0, "max_abs_diff": 0.0, "max_abs_diff_given_routing": 0.0}
            for t in TOKENS:
                x = torch.randn(t, HIDDEN, generator=gen).to(device, dtype)
                fused = moe(x)
                reference = moe.reference(x)
                weights, ids, counts = moe_kernels.route(x, moe.gate.weight, top_k, normalize)
                row["route_counts_ok"] = row.get("route_counts_ok", True) and torch.equal(
                    counts.sum(0).cpu(), group_counts(ids.cpu(), experts, group=10 ** 9).sum(0))
                ref_weights, ref_ids = moe.route(x)
                alike = (ids.long() == ref_ids).all(dim=1)  # [T]
                row["route_agreement"] = min(row["route_agreement"], alike.float().mean().item())
                if alike.any():
                    row["max_abs_diff"] = max(row["max_abs_diff"],
                                              (fused - reference).float()[alike].abs().max().item())
                    row["route_weight_diff"] = max(row.get("route_weight_diff", 0.0),
                                                   (weights - ref_weights.float())[alike].abs().max().item())
                exact = given_routing(moe, x, weights, ids)
                row["max_abs_diff_given_routing"] = max(row["max_abs_diff_given_routing"],
                                                        (fused.float() - exact).abs().max().item())
                row["scale"] = max(row.get("scale", 0.0), exact.abs().max().item())
            x = torch.randn(37, HIDDEN, generator=gen).to(device, dtype)
            row["tokens_invariant"] = tokens_invariant(moe, x)
            row["stacked_views"] = stacked_views(moe)
            results[f"{name}/{dtype}"] = row
    results["router_chunks"] = router_chunks_agree(device)
    results["plan_valid"] = all(plan_valid(e, p, device) for e, p in [(6, 1), (6, 7), (8, 74), (8, 300), (128, 1),
                                                                     (128, 300), (128, 2000), (6, 1100)])
    return results


def model_check(device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """A tiny Qwen3-MoE target (tests.helpers' ``qwen3_moe``) with the fused kernels against the
    reference path: a prefill, a tree, a feature-sink step (tests/support/kernel_checks.py's run);
    the largest difference per output, and whether each path reads its routing on the host."""
    from tests.helpers import ours_from_hf, tiny_hf_model
    from tests.support.kernel_checks import _run

    model = ours_from_hf(tiny_hf_model("qwen3_moe"), device=device, dtype=dtype)
    model.use_gpu_kernels(False)
    host_before = routes_on_host(model)
    reference = _run(model, device)
    assert model.use_gpu_kernels(attention=True), "the fused kernels did not switch on"
    fused = _run(model, device)
    diffs = {f"model/{name}": (reference[name].float() - fused[name].float()).abs().max().item() for name in reference}
    return {"diffs": diffs, "routes_on_host_reference": host_before, "routes_on_host_fused": routes_on_host(model)}


def main() -> None:
    print(json.dumps({"kernels": check(), "model": model_check()}))


if __name__ == "__main__":
    main()
