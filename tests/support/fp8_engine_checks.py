"""FP8 checkpoints end to end (issue #38): a tiny random target written as an FP8 checkpoint (e4m3 weights and
their scales, ``quantization_config``) and a random DFlash drafter for it. Where the FP8 product runs (CUDA, or
Triton's interpreter on the CPU) the target keeps its linears FP8 (:class:`Fp8Linear`), and in the exact mode
plain decoding, the DFlash chain and DDTree give the same greedy tokens at batch 1 and 3; the FP8 model's logits
are those of the same checkpoint dequantized at load, up to rounding.

Run on CUDA in float32 and bfloat16 by tests/gpu/test_fp8_gemm.py, and as
``python -m tests.support.fp8_engine_checks WORKDIR`` under ``TRITON_INTERPRET=1`` on CPU tensors (float32) by
tests/integration/test_fp8_gemm.py; :func:`compare_fp8_engine` returns (prints) counts of differing token lists,
all 0 when FP8 speculative decoding is lossless."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

# the target shapes: "tiny" fuses q/k/v parts of 64/32/32 rows (block scales become per-row factors);
# "blocks" fuses parts of 256/128/128 and 256/256 rows (block scales stay 128 x 128 blocks) over 1-2 K blocks
SHAPES = {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16},
          "blocks": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 64}}
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4]]
VOCAB = 64


def write_fp8_target(directory: Path, layout: str = "block", shape: str = "tiny", layers: int = 2,
                     seed: int = 0) -> tuple[Path, Path]:
    """(an FP8 checkpoint, the same model's checkpoint in float32) of a tiny random Qwen3 target: every
    attention and MLP projection quantized with 128 x 128 block scales (``layout`` "block", quant_method fp8)
    or per-channel scales ("channel", compressed-tensors); embeddings, norms and the LM head float32."""
    import safetensors.torch
    import transformers

    from flashtree.models.fp8 import dequantized, quantize_fp8

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, rope_theta=10000.0, **SHAPES[shape])
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # less flat than the default init, so argmax decisions are meaningful
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    fp8, reference = directory / f"fp8-{layout}-{shape}", directory / f"reference-{layout}-{shape}"
    hf.save_pretrained(fp8)
    state = safetensors.torch.load_file(str(fp8 / "model.safetensors"))
    tensors = {}
    for name, tensor in state.items():
        if name.endswith(".weight") and any(f".{p}." in name for p in QUANTIZED):
            values, scale = quantize_fp8(tensor, blocks=layout == "block")
            tensors[name], tensors[name + ("_scale_inv" if layout == "block" else "_scale")] = values, scale
        else:
            tensors[name] = tensor
    shutil.copytree(fp8, reference)
    safetensors.torch.save_file(tensors, str(fp8 / "model.safetensors"))
    safetensors.torch.save_file({name: dequantized(name, tensors, torch.float32) for name in state},
                                str(reference / "model.safetensors"))  # the FP8 weights dequantized, exactly
    quantization = ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]} if layout == "block" else
                    {"quant_method": "compressed-tensors", "format": "float-quantized"})
    raw = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization}))
    return fp8, reference


def _llm(target: Path, drafter: Path | None, spec: str, device: str, dtype: str, max_running: int = 3):
    from flashtree import LLM

    return LLM(str(target), spec=spec, draft=str(drafter) if spec != "none" else None, budget=6, device=device,
               dtype=dtype, exact=True, adaptive_spec=False, max_running=max_running, max_context=64)


def fp8_layers(model) -> list:
    """The FP8 holders of every dense linear group of ``model`` (empty when it dequantized at load)."""
    from flashtree.kernels.gpu.fp8_gemm import Fp8Linear

    holders = [getattr(module, attr) for layer in model.model.layers
               for module, attr in ((layer.self_attn, "qkv_quant"), (layer.self_attn, "o_quant"),
                                    (layer.mlp, "gate_up_quant"), (layer.mlp, "down_quant"))]
    return [h for h in holders if isinstance(h, Fp8Linear)]


def logits_vs_dequantized(fp8: Path, reference: Path, device: str, dtype: str, exact: bool = True) -> float:
    """Largest difference of a causal prefill's logits (the exact or the fast backend), FP8 products vs the
    checkpoint dequantized, relative to the largest logit."""
    from flashtree.config import EngineConfig
    from flashtree.models.batch import ForwardBatch, causal_mask
    from flashtree.models.build import load_target, resolve_dtype
    from tests.helpers import make_cache

    width = max(len(p) for p in PROMPTS)
    counts = torch.tensor([len(p) for p in PROMPTS])
    logits = []
    for path in (fp8, reference):
        config = EngineConfig.of(model=str(path), device=device, dtype=dtype, exact=exact)
        model = load_target(config, torch.device(device), resolve_dtype(dtype, torch.device(device))).model
        assert path == reference or fp8_layers(model), "the FP8 products did not switch on"
        batch = ForwardBatch(torch.tensor([p + [0] * (width - len(p)) for p in PROMPTS], device=device),
                             torch.arange(width, device=device).expand(len(PROMPTS), -1),
                             torch.arange(len(PROMPTS), device=device), torch.zeros_like(counts, device=device),
                             causal_mask(counts, width).to(device), kv_len=width, prefill=True)
        logits.append(model(batch, make_cache(model), logits_index=(counts - 1)[:, None].to(device)).logits.double())
    return ((logits[0] - logits[1]).abs().max() / logits[1].abs().max()).item()


def compare_fp8_engine(device: str, workdir: str, dtype: str = "float32", layout: str = "block",
                       shape: str = "tiny", max_tokens: int = 16,
                       specs: tuple[str, ...] = ("dflash", "ddtree")) -> dict[str, float]:
    from flashtree import SamplingParams
    from tests.dflash_helpers import save_tiny_drafter

    root = Path(workdir)
    target, _ = write_fp8_target(root, layout, shape)
    drafter = save_tiny_drafter(target, root / f"drafter-{layout}-{shape}", block_size=5, layers=1, seed=1)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = _llm(target, None, "none", device, dtype)
    holders = fp8_layers(plain.engine.model)
    assert len(holders) == 4 * plain.engine.model.config.num_hidden_layers, "the FP8 products did not switch on"
    assert plain.engine.model.kernels.EXACT, "the exact backend did not switch on"
    together = [o.token_ids for o in plain.generate(PROMPTS, params)]
    alone = [plain.generate([p], params)[0].token_ids for p in PROMPTS]
    diffs = {"plain/alone_vs_batch_3": sum(a != b for a, b in zip(together, alone)),
             "scale_rows_128": float(all(h.scale_rows == 128 for h in holders))}  # informative: which path ran
    for spec in specs:
        llm = _llm(target, drafter, spec, device, dtype)
        batched = [o.token_ids for o in llm.generate(PROMPTS, params)]
        single = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
        diffs[f"{spec}/vs_plain_batch_3"] = sum(a != b for a, b in zip(batched, together))
        diffs[f"{spec}/vs_plain_batch_1"] = sum(a != b for a, b in zip(single, alone))
    return {k: float(v) for k, v in diffs.items()}


if __name__ == "__main__":  # the interpreter is slow: the tiny shape, fewer tokens, DDTree only (a chain is a causal tree)
    work = Path(sys.argv[1])
    fp8_dir, reference_dir = write_fp8_target(work / "logits", "block", "tiny")
    print(json.dumps({"tokens_differing": compare_fp8_engine("cpu", str(work), max_tokens=6, specs=("ddtree",)),
                      "logits_vs_dequantized": logits_vs_dequantized(fp8_dir, reference_dir, "cpu", "float32")}))
