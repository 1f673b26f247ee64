"""H100 / H200: FlashInfer's paged prefill with a custom mask against flashtree's Triton tree attention, one layer
at the round shapes of gpu_tree_attention.py (issue #39 item 2: keep the faster as the GPU default, the other as a
fallback).

    PYTHONPATH=.:/root/stash/site python benchmarks/gpu_flashinfer_attention.py --out OUT.json

FlashInfer on the device (no network there): `flashinfer-python` 0.7.4 with apache-tvm-ffi (cp312), einops,
tabulate, click and nvidia-ml-py, unzipped into /root/stash/site from one 22 MB archive (the wheel is 101 MB, more
than a call carries beside the tracked tree; gpu_next_checks.sh CALL=15 says how the archive is made). Its FA2
prefill kernel compiles on first use (about 35 s on the H100, 2026-12-06). Result that day: the Triton kernel was
faster at every shape (1.15-2.7x; journal/session-32-2026-12-06.md).

The same inputs as gpu_tree_attention.py (Qwen3-8B heads, 16-entry pages in shuffled order, about ``--context``
committed entries a row, random trees): FlashInfer reads them as an HND paged cache (the layout flashtree keeps),
each row's keys its committed pages and the tree's entries after them, the mask flattened per row ([new,
committed + new]: the committed columns all visible). Each side is timed as a CUDA graph of ``--layers`` calls on
layers of their own K/V (FlashInfer's wrapper built for graphs, planned once outside the capture); the outputs are
compared (bf16). ``--check-inputs`` runs on the CPU: the FlashInfer inputs read back by a plain torch attention
equal the engine's attention of the same forward.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashtree.kernels.gpu.attention import default_tile, tree_attention  # noqa: E402
from gpu_tree_attention import FORWARDS, HEADS, KV_HEADS, PAGE, floor_us, forward_inputs  # noqa: E402

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace


def flashinfer_inputs(inputs: dict) -> dict:
    """The forward as FlashInfer's paged prefill takes it: int32 indptrs over rows' query tokens and pages, the
    rows' page ids, entries in each row's last page, and the flattened per-row custom mask [new, kv_len]."""
    batch, new = inputs["mask"].shape[:2]
    kv_len = inputs["lengths"].long() + new  # [B] keys a row's tokens may see: committed context, then the tree
    pages = (kv_len + PAGE - 1) // PAGE  # [B]
    zero = torch.zeros(1, dtype=torch.long, device=kv_len.device)
    masks = [torch.cat([torch.ones(new, int(kv_len[b]) - new, dtype=torch.bool, device=kv_len.device),
                        inputs["mask"][b]], dim=1).reshape(-1) for b in range(batch)]  # each [new * kv_len[b]]
    return {"qo_indptr": (torch.arange(batch + 1, device=kv_len.device) * new).int(),
            "paged_kv_indptr": torch.cat([zero, pages.cumsum(0)]).int(),
            "paged_kv_indices": torch.cat([inputs["table"][b, :int(pages[b])] for b in range(batch)]).int(),
            "paged_kv_last_page_len": (kv_len - (pages - 1) * PAGE).int(),
            "custom_mask": torch.cat(masks)}


def ragged_queries(q: torch.Tensor) -> torch.Tensor:
    """[B, H, N, D] -> [B * N, H, D] (FlashInfer's query rows, token-major)."""
    b, h, n, d = q.shape
    return q.permute(0, 2, 1, 3).reshape(b * n, h, d).contiguous()


def reference_from_flashinfer_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fi: dict) -> torch.Tensor:
    """Attention as FlashInfer's inputs define it, in plain float32 torch: q [B*N, H, D], k / v [pages, KV, PAGE, D]
    -> [B*N, H, D]."""
    out = []
    qo, kv, last = fi["qo_indptr"].tolist(), fi["paged_kv_indptr"].tolist(), fi["paged_kv_last_page_len"].tolist()
    mask_at = 0
    for b in range(len(qo) - 1):
        ids = fi["paged_kv_indices"][kv[b]:kv[b + 1]].long()
        kv_len = (len(ids) - 1) * PAGE + last[b]
        keys = k[ids].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, k.shape[-1])[:, :kv_len].float()  # [KV, T, D]
        values = v[ids].permute(1, 0, 2, 3).reshape(KV_HEADS, -1, v.shape[-1])[:, :kv_len].float()
        rows = qo[b + 1] - qo[b]
        mask = fi["custom_mask"][mask_at:mask_at + rows * kv_len].view(rows, kv_len)
        mask_at += rows * kv_len
        query = q[qo[b]:qo[b + 1]].float().transpose(0, 1)  # [H, N, D]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


def check_inputs(batch: int = 3, context: int = 40) -> dict:
    """CPU: for every forward kind, FlashInfer's inputs read back by the reference equal SDPA over the engine's own
    view of the forward (committed context visible, the tree by its mask) within float32 rounding."""
    from flashtree.models.batch import ForwardBatch, attention_mask

    diffs = {}
    for name, (new, kind) in FORWARDS.items():
        gen = torch.Generator().manual_seed(new)
        inputs = forward_inputs(batch, new, kind, context, 1, gen, max_context=256, device="cpu")
        k, v = inputs["k"][0], inputs["v"][0]
        fi = flashinfer_inputs(inputs)
        got = reference_from_flashinfer_inputs(ragged_queries(inputs["q"]), k, v, fi)
        lengths = inputs["lengths"]
        kv_len = int(lengths.max()) + new
        flat_k, flat_v = (c[inputs["table"]].permute(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, -1, c.shape[-1])
                          [:, :, :kv_len].float() for c in (k, v))  # [B, KV, T, D] through the block table
        forward = ForwardBatch(torch.zeros(batch, new, dtype=torch.long), torch.zeros(batch, new, dtype=torch.long),
                               inputs["slots"], lengths, inputs["mask"], kv_len)
        want = torch.nn.functional.scaled_dot_product_attention(
            inputs["q"].float(), flat_k, flat_v, attn_mask=attention_mask(forward), enable_gqa=True)
        diffs[name] = (got - ragged_queries(want)).abs().max().item()
    return diffs


def flashinfer_runner(inputs: dict, layers: int):
    """A FlashInfer wrapper planned for ``inputs`` (buffers fixed, so its run can be captured) and a call per layer."""
    import flashinfer

    fi = flashinfer_inputs(inputs)
    device = inputs["q"].device
    packed_bytes = fi["custom_mask"].numel() // 8 + len(fi["qo_indptr"]) + 16  # each row's bits padded to bytes
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), kv_layout="HND", use_cuda_graph=True,
        qo_indptr_buf=torch.empty_like(fi["qo_indptr"]), paged_kv_indptr_buf=torch.empty_like(fi["paged_kv_indptr"]),
        paged_kv_indices_buf=torch.empty_like(fi["paged_kv_indices"]),
        paged_kv_last_page_len_buf=torch.empty_like(fi["paged_kv_last_page_len"]),
        custom_mask_buf=torch.empty(packed_bytes, dtype=torch.uint8, device=device),
        mask_indptr_buf=torch.empty_like(fi["qo_indptr"]))
    head_dim = inputs["q"].shape[-1]
    wrapper.plan(fi["qo_indptr"], fi["paged_kv_indptr"], fi["paged_kv_indices"], fi["paged_kv_last_page_len"],
                 HEADS, KV_HEADS, head_dim, PAGE, custom_mask=fi["custom_mask"], q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=1 / math.sqrt(head_dim))
    q = ragged_queries(inputs["q"])
    calls = [lambda layer=layer: wrapper.run(q, (inputs["k"][layer], inputs["v"][layer])) for layer in range(layers)]
    return wrapper, calls


def measure(batch: int, name: str, args) -> dict:
    from gpu_fp8 import time_calls_us
    from round_roofline import machine_of

    new, kind = FORWARDS[name]
    inputs = forward_inputs(batch, new, kind, args.context, args.layers, torch.Generator().manual_seed(batch * 1000 + new))
    tile = default_tile(new * HEADS // KV_HEADS, torch.bfloat16)
    ours = [lambda layer=layer: tree_attention(inputs["q"], inputs["k"][layer], inputs["v"][layer], inputs["table"],
                                               inputs["slots"], inputs["lengths"], inputs["mask"], tile=tile)
            for layer in range(args.layers)]
    row = {"batch": batch, "forward": name, "new_tokens": new,
           "floor_us": floor_us(inputs, machine_of(torch.cuda.get_device_name()).bandwidth),
           "flashtree_us": time_calls_us(ours, "cuda", args.reps)}
    try:
        wrapper, theirs = flashinfer_runner(inputs, args.layers)
        reference = ragged_queries(ours[0]())
        row["flashinfer_max_abs_diff"] = (theirs[0]().float() - reference.float()).abs().max().item()
        row["flashinfer_backend"] = str(getattr(wrapper, "_backend", "?"))
        row["flashinfer_us"] = time_calls_us(theirs, "cuda", args.reps)
    except Exception as error:  # (a shape FlashInfer does not take, a build that fails: recorded, not fatal)
        row["flashinfer_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--forwards", default="plain,ddtree4,dflash16,ddtree16,ddtree64,drafter16")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--check-inputs", action="store_true", help="CPU: check the FlashInfer inputs, then exit")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.check_inputs:
        diffs = check_inputs()
        print(json.dumps(diffs))
        sys.exit(0 if max(diffs.values()) < 1e-4 else 1)
    if args.out is None:
        parser.error("--out is required (except with --check-inputs)")
    rows, started = [], time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for batch in map(int, args.batches.split(",")):
        for name in args.forwards.split(","):
            rows.append(measure(batch, name, args))
            row = rows[-1]
            theirs = row.get("flashinfer_us", row.get("flashinfer_error"))
            print(f"b={batch:3d} {name:9s} floor {row['floor_us']:7.1f} us  flashtree {row['flashtree_us']:7.1f}  "
                  f"flashinfer {theirs}  ({time.perf_counter() - started:.0f} s)", flush=True)
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "context": args.context,
                                            "layers": args.layers, "rows": rows}, indent=1))
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
