"""FP8 checkpoints (block-wise 128 x 128 e4m3 with weight_scale_inv, and compressed-tensors' per-channel
weight_scale) load dequantized: the same model, bit for bit, as a checkpoint of the dequantized
weights; a quantization the loader cannot read is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch

from flashtree import LLM, SamplingParams
from flashtree.errors import CheckpointError
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
