"""CUDA: each profiled run of the activation reserve (engine/memory_profile.py) for the tiny DDTree-32 engine of
tests/gpu/test_paged_kv.py, as the caching allocator's allocated and reserved growth (session 32's CALL=13: reserved
growth of 2-4 MiB for rounds whose logits alone are 135 MB), then the reserve the engine took.

    PYTHONPATH=. python benchmarks/gpu_reserve_probe.py
"""
import os
import tempfile
from pathlib import Path

import torch

import flashtree.engine.engine as engine_module
from flashtree import LLM
from flashtree.engine.memory_profile import peak_bytes
from tests.dflash_helpers import tiny_pair

print("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))


def traced(device, run):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    inactive = torch.cuda.memory_stats()["inactive_split_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    print(f"allocated peak +{(torch.cuda.max_memory_allocated() - a0) / 2**20:.1f} MiB, reserved peak "
          f"+{(torch.cuda.max_memory_reserved() - r0) / 2**20:.1f} MiB; before: allocated {a0 / 2**20:.1f}, reserved "
          f"{r0 / 2**20:.1f}, inactive split {inactive / 2**20:.1f} MiB", flush=True)
    return peak_bytes(device, run)


engine_module.peak_bytes = traced
pair = tiny_pair(Path(tempfile.mkdtemp()), vocab=32000, block_size=16)
free, total = torch.cuda.mem_get_info()
llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=32, adaptive_spec=False, device="cuda",
          dtype="bfloat16", gpu_memory_utilization=(total - free) / total + 0.12, max_context=512, max_running=64)
print(llm.engine.activation_reserve)
