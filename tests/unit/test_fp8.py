"""FP8 checkpoints (block-wise 128 x 128 e4m3 with weight_scale_inv, and compressed-tensors' per-channel
weight_scale) load dequantized on the CPU: the same model, bit for bit, as a checkpoint of the dequantized
weights; a quantization the loader cannot read is refused by name. The FP8 holders the CUDA path keeps
(kernels/gpu/fp8_gemm.py's Fp8Linear, fused as the model fuses q/k/v and gate/up) stand for exactly the
weights the CPU dequantizes; their products run in tests/integration/test_fp8_gemm.py (interpreter) and
tests/gpu/test_fp8_gemm.py."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch

from flashtree import LLM, SamplingParams
from flashtree.errors import CheckpointError
from flashtree.kernels.gpu.fp8_gemm import Fp8Linear
from flashtree.models.fp8 import dequantized, fused_fp8, quantize_fp8, read_fp8
from flashtree.models.loader import load_checkpoint
from tests.helpers import tiny_hf_model

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, scale tensor, the dequantized weight) of a [N, K] weight."""
    if layout == "block":
        rows, cols = weight.shape
        padded = torch.zeros(-(-rows // 128) * 128, -(-cols // 128) * 128)
        padded[:rows, :cols] = weight
        blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [rb, cb]
        factor = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    else:
        scale = weight.abs().amax(dim=1, keepdim=True) / 448.0  # [N, 1]
        factor = scale
    values = (weight / factor).to(torch.float8_e4m3fn)
    return values, scale, values.float() * factor


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """layout -> (FP8 checkpoint, checkpoint of the dequantized weights)."""
    root = tmp_path_factory.mktemp("fp8")
    hf = tiny_hf_model("qwen3_qknorm", vocab_size=97)
    base = root / "base"
    hf.save_pretrained(base)
    state = safetensors.torch.load_file(str(base / "model.safetensors"))
    out = {}
    for layout in ("block", "channel"):
        fp8, reference = dict(state), dict(state)
        for name, tensor in state.items():
            if name.endswith(".weight") and any(p in name for p in QUANTIZED):
                values, scale, dequantized = _quantize(tensor.float(), layout)
                fp8[name] = values
                fp8[name + ("_scale_inv" if layout == "block" else "_scale")] = scale
                reference[name] = dequantized
        config = json.loads((base / "config.json").read_text())
        quantization = ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                         "activation_scheme": "dynamic"} if layout == "block" else
                        {"quant_method": "compressed-tensors", "format": "float-quantized"})
        dirs = []
        for kind, tensors, quant in (("fp8", fp8, quantization), ("reference", reference, None)):
            directory = root / f"{layout}-{kind}"
            shutil.copytree(base, directory)
            safetensors.torch.save_file(tensors, str(directory / "model.safetensors"))
            (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quant}
                                                              if quant else config))
            dirs.append(directory)
        out[layout] = tuple(dirs)
    return out


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_an_fp8_checkpoint_is_its_dequantized_model(checkpoints, layout):
    fp8_dir, reference_dir = checkpoints[layout]
    fp8, reference = LLM(str(fp8_dir), max_running=2), LLM(str(reference_dir), max_running=2)
    for (name, a), (_, b) in zip(fp8.engine.model.named_parameters(), reference.engine.model.named_parameters()):
        assert torch.equal(a, b), name
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [50, 60]]
    assert [o.token_ids for o in fp8.generate(prompts, params)] == [o.token_ids for o in reference.generate(prompts, params)]


def test_a_quantization_the_loader_cannot_read_is_refused(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints["block"]
    bad = tmp_path / "awq"
    shutil.copytree(fp8_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not supported; allowed: fp8"):
        LLM(str(bad))
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"weight_block_size \[64, 64\] is not supported"):
        LLM(str(bad))


@pytest.mark.parametrize("blocks", [True, False])
def test_quantize_fp8_round_trips_within_e4m3_precision(blocks):
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    weight[:128, :128] = 0  # an all-zero block: scale 1, values 0
    values, scale = quantize_fp8(weight, blocks)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == ((3, 2) if blocks else (300, 1))
    back = dequantized("w", {"w": values, "w_scale_inv" if blocks else "w_scale": scale}, torch.float32)
    assert torch.all((back - weight).abs() <= weight.abs() / 16 + scale.max() / 512)  # 3 mantissa bits, subnormals
    assert (back - weight).abs().max() > 0  # (it is lossy: the check reads real values)


def _parts(rows: list[int], width: int, blocks: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(sum(rows))
    tensors = {}
    for i, n in enumerate(rows):
        values, scale = quantize_fp8(torch.randn(n, width, generator=gen) * (i + 1), blocks)
        tensors[f"p{i}"], tensors[f"p{i}" + ("_scale_inv" if blocks else "_scale")] = values, scale
    return tensors


@pytest.mark.parametrize("rows,blocks,scale_rows", [([256, 128, 128], True, 128), ([64, 32, 40], True, 1),
                                                    ([128, 40], True, 128), ([64, 32], False, 1)])
def test_a_fused_fp8_group_stands_for_its_parts_dequantized(rows, blocks, scale_rows):
    tensors = _parts(rows, 300, blocks)
    names = [f"p{i}" for i in range(len(rows))]
    fused = fused_fp8(names, tensors, torch.device("cpu"))
    assert fused.scale_rows == scale_rows  # block scales stay blocks where every part but the last fills them
    assert (fused.out_features, fused.in_features) == (sum(rows), 300)
    assert torch.equal(fused.dequantize(), torch.cat([dequantized(n, tensors, torch.float32) for n in names]))


def test_fp8_scales_that_do_not_fit_are_refused_by_name():
    tensors = _parts([64], 300, True)
    with pytest.raises(CheckpointError, match=r"p0_scale_inv has shape \[2, 3\]; a \[64, 300\] .* needs \[1, 3\]"):
        dequantized("p0", {**tensors, "p0_scale_inv": torch.ones(2, 3)}, torch.float32)
    with pytest.raises(CheckpointError, match=r"p0_scale has shape \[3, 1\]; allowed .* \[64, 1\]"):
        dequantized("p0", {"p0": tensors["p0"], "p0_scale": torch.ones(3, 1)}, torch.float32)
    with pytest.raises(CheckpointError, match="p0 is stored in torch.float8_e4m3fn without p0_scale_inv"):
        dequantized("p0", {"p0": tensors["p0"]}, torch.float32)
    mixed = {**tensors, **{k.replace("p0", "p1"): v for k, v in _parts([64], 128, True).items()}}
    with pytest.raises(CheckpointError, match="p0, p1 are fused into one product and need one FP8 dtype and one width"):
        fused_fp8(["p0", "p1"], mixed, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"w: scales of shape \[2, 3\] do not fit a \[64, 300\] weight"):
        Fp8Linear(tensors["p0"], torch.ones(2, 3), 128, name="w")


def test_the_cpu_keeps_dequantizing_without_the_interpreter(checkpoints, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert read_fp8(load_checkpoint(str(checkpoints["block"][0])), torch.device("cpu")) == {}
