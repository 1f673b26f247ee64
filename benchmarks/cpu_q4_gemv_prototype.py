"""Prototype (not engine code): serve SmolLM2's batch-1 matmuls straight from the GGUF blocks.

SmolLM2 ships as a Q4_1 GGUF (layers; the tied embedding / lm_head is Q8_0) that flashtree
dequantizes once to float32. On a 2-core CPU a decode step streams those 538 MB of fp32 weights
and is bound by memory bandwidth (about 23 GB/s here). This prototype keeps the GGUF blocks
(0.75 bytes per Q4_1 weight with fp32 block scales, 1.125 per Q8_0 weight) and multiplies with a
small AVX-512 kernel that rebuilds every weight in registers exactly as the converter stored it
(Q4_1: fma(d, q, m), and d*q is exact so that is the same single rounding as d*q + m; Q8_0: d*q,
exact) and accumulates in fp32. Weight values are bit-identical to the engine's (asserted); only
the summation order differs from MKL's sgemv.

It patches ``torch.nn.functional.linear`` for batch-1 calls on those weights only, then times
the unchanged engine, the patched engine and transformers ``generate`` on the same prompts,
interleaved, and checks the tokens. Needs g++ and an AVX-512 CPU (the kernel builds at start).

    python benchmarks/cpu_q4_gemv_prototype.py [--new-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_q4_gemv_prototype.json"
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works and when to use one.",
    "What are three tips for staying focused while studying?",
    "Write a Python function that checks whether a string is a palindrome.",
]
KERNELS = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// y[n] = sum_k x[k] * (d[n,b] * q[n,k] + m[n,b]), b = k / 32. codes [N, K/2]: per 32-block
// 16 bytes, low nibble = element j, high nibble = element j + 16 (the GGUF layout).
torch::Tensor q4_1_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  const int64_t N = codes.size(0), K = x.size(-1), B = K / 32;
  auto y = torch::empty({N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *dp = d.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  at::parallel_for(0, N, 64, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      const uint8_t* row = cp + n * (K / 2);
      for (int64_t b = 0; b < B; ++b) {
        __m128i v = _mm_loadu_si128((const __m128i*)(row + b * 16));
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4)));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4)));
        __m512 scale = _mm512_set1_ps(dp[n * B + b]), offset = _mm512_set1_ps(mp[n * B + b]);
        acc0 = _mm512_fmadd_ps(_mm512_fmadd_ps(scale, q0, offset), _mm512_loadu_ps(xp + b * 32), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_fmadd_ps(scale, q1, offset), _mm512_loadu_ps(xp + b * 32 + 16), acc1);
      }
      yp[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
  });
  return y;
}

// y[n] = sum_k x[k] * (d[n,b] * q[n,k]); codes [N, K] int8.
torch::Tensor q8_0_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor d) {
  const int64_t N = codes.size(0), K = x.size(-1), B = K / 32;
  auto y = torch::empty({N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      const int8_t* row = cp + n * K;
      for (int64_t b = 0; b < B; ++b) {
        __m512 scale = _mm512_set1_ps(dp[n * B + b]);
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + b * 32))));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + b * 32 + 16))));
        acc0 = _mm512_fmadd_ps(_mm512_mul_ps(scale, q0), _mm512_loadu_ps(xp + b * 32), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_mul_ps(scale, q1), _mm512_loadu_ps(xp + b * 32 + 16), acc1);
      }
      yp[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
  });
  return y;
}
"""


def build_kernels():
    from torch.utils.cpp_extension import load_inline

    return load_inline("flashtree_q4_gemv_prototype", cpp_sources=KERNELS, functions=["q4_1_gemv", "q8_0_gemv"],
                       extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mfma", "-fopenmp"], verbose=False)


# ------------------------------------------------------------------------- GGUF blocks

def fp16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[:, :, offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def q4_1_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 bytes ``[rows, blocks * 20]`` -> packed codes ``[rows, K/2]``, d and m ``[rows, K/32]``."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    return np.ascontiguousarray(blocks[:, :, 4:]).reshape(raw.shape[0], -1), fp16_field(blocks, 0), fp16_field(blocks, 2)


def q8_0_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes ``[rows, blocks * 34]`` -> codes ``[rows, K]`` int8, d ``[rows, K/32]``."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    return np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(raw.shape[0], -1), fp16_field(blocks, 0)


def read_gguf_blocks(config) -> dict[str, tuple[np.ndarray, ...]]:
    """Every quantized tensor's blocks, q/k rows un-permuted like flashtree's converter does."""
    import gguf

    from flashtree.models.gguf_convert import unpermute_rotary_rows
    from flashtree.models.loader import EMBEDDED_MODELS, embedded_gguf_path

    reader = gguf.GGUFReader(str(embedded_gguf_path(EMBEDDED_MODELS["smollm2"])))
    found = {}
    for tensor in reader.tensors:
        raw = np.asarray(tensor.data, dtype=np.uint8)
        if tensor.tensor_type.name == "Q8_0":
            found[tensor.name] = q8_0_blocks(raw)
        elif tensor.tensor_type.name == "Q4_1":
            parts = q4_1_blocks(raw)
            if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
                heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
                parts = tuple(unpermute_rotary_rows(p, heads) for p in parts)
            found[tensor.name] = parts
    return found


# ------------------------------------------------------------------------- linears

class Q41Weight:
    def __init__(self, parts, kernels):
        self.codes, self.d, self.m = (torch.from_numpy(np.concatenate(p)) for p in zip(*parts))
        self.kernels = kernels

    def dense(self) -> torch.Tensor:
        packed = self.codes.view(self.codes.shape[0], -1, 16).long()
        q = torch.cat([packed & 15, packed >> 4], dim=2).float()  # [N, K/32, 32]
        return (self.d[:, :, None] * q + self.m[:, :, None]).reshape(self.codes.shape[0], -1)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q4_1_gemv(x, self.codes, self.d, self.m)


class Q80Weight:
    def __init__(self, parts, kernels):
        self.codes, self.d = (torch.from_numpy(p) for p in parts)
        self.kernels = kernels

    def dense(self) -> torch.Tensor:
        return (self.d[:, :, None] * self.codes.view(self.codes.shape[0], -1, 32).float()).reshape(self.codes.shape[0], -1)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_0_gemv(x, self.codes, self.d)


def block_weights(model, blocks, kernels) -> dict[int, Q41Weight | Q80Weight]:
    """{data_ptr of an engine weight: its GGUF blocks}; every one checked bit-identical."""
    table = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"blk.{i}."
        for weight, names in ((attn.qkv_weight, ["attn_q", "attn_k", "attn_v"]), (attn.o_proj.weight, ["attn_output"]),
                              (mlp.gate_up, ["ffn_gate", "ffn_up"]), (mlp.down_proj.weight, ["ffn_down"])):
            q = Q41Weight([blocks[p + n + ".weight"] for n in names], kernels)
            assert torch.equal(q.dense(), weight), f"layer {i} {names}: GGUF blocks differ from the engine's weights"
            table[weight.data_ptr()] = q
    head = Q80Weight(blocks["token_embd.weight"], kernels)
    assert torch.equal(head.dense(), model.lm_head.weight), "lm_head: GGUF blocks differ from the engine's weights"
    table[model.lm_head.weight.data_ptr()] = head
    return table


def block_linear(table, dense_linear):
    """F.linear that takes batch-1 products on known weights from the blocks."""

    def linear(x, weight, bias=None):
        blocks = table.get(weight.data_ptr()) if bias is None and x.numel() == x.shape[-1] else None
        if blocks is None:
            return dense_linear(x, weight, bias)
        return blocks.gemv(x.reshape(-1).contiguous()).view(*x.shape[:-1], -1)

    return linear


# ------------------------------------------------------------------------- timing

def transformers_tokens(hf, prompt_ids, new_tokens):
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    import flashtree
    from flashtree.bench.environment import environment
    from flashtree.models.loader import load_checkpoint
    from flashtree.models.tokenizer import encode_chat

    llm = flashtree.LLM("smollm2", device="cpu", dtype="float32", max_running=1, max_context=1024)
    hf = transformers.AutoModelForCausalLM.from_pretrained(load_checkpoint("smollm2").path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    dense_linear = F.linear
    fast_linear = block_linear(block_weights(llm.engine.model, read_gguf_blocks(llm.engine.model.config),
                                             build_kernels()), dense_linear)
    params = flashtree.SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    prompts = [encode_chat(llm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    llm.generate([prompts[0]], flashtree.SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    seconds = {"flashtree fp32": [], "flashtree + GGUF-block GEMV": [], "transformers": []}
    identical = []
    for prompt in prompts:
        reference, s = timed(lambda: llm.generate([prompt], params)[0].token_ids)
        seconds["flashtree fp32"].append(s)
        torch.nn.functional.linear = fast_linear
        try:
            ours, s = timed(lambda: llm.generate([prompt], params)[0].token_ids)
        finally:
            torch.nn.functional.linear = dense_linear
        seconds["flashtree + GGUF-block GEMV"].append(s)
        theirs, s = timed(lambda: transformers_tokens(hf, prompt, args.new_tokens))
        seconds["transformers"].append(s)
        identical.append(ours == reference == theirs)
    rates = {name: round(args.new_tokens * len(prompts) / sum(ts), 2) for name, ts in seconds.items()}
    summary = {"tokens_per_s": rates, "speedup_vs_transformers": {
        name: round(rate / rates["transformers"], 3) for name, rate in rates.items()}, "tokens_identical": identical}
    config = {**environment(torch.device("cpu")), "threads": args.threads, "new_tokens": args.new_tokens, "prompts": PROMPTS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "summary": summary, "seconds": seconds}, indent=2) + "\n")
    print("| system | tokens/s | vs transformers |\n| --- | --- | --- |")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {summary['speedup_vs_transformers'][name]:.2f}x |")
    print(f"tokens identical (patched engine == engine == transformers), per prompt: {identical}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
