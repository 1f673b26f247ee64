"""Config-only model directories at real sizes, for random-weight speed runs."""

import json
from pathlib import Path

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "eos_token_id": 151645,
}

# z-lab/Qwen3-8B-DFlash-b16 shape (DESIGN.md section 2)
QWEN3_8B_DFLASH = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "block_size": 16, "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "mask_token": "<|MASK|>"},
}


# HuggingFaceTB/SmolLM2-135M-Instruct, the shipped drafter's target (flashtree/assets/smollm2-dflash)
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "eos_token_id": 2,
}


def write_config(directory: str | Path, config: dict) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


SMOLLM2_VOCAB = {"vocab_size": 49152, "eos_token_id": 2}  # the served pair's tokenizer (no Qwen tokenizer on the device)


def write_served_pair(target_dir: str | Path, drafter_dir: str | Path, small: dict | None = None) -> tuple[Path, Path]:
    """The pair ``gpu_load.sh`` serves: Qwen3-8B's shape with SmolLM2's vocabulary, and the z-lab
    Qwen3-8B-DFlash-b16 shape with SmolLM2's ``<issue_start>`` (id 8) as the mask token. ``small``
    overrides the shape (a tiny one for a CPU dry run; the drafter then has one layer reading the
    first and last target layers)."""
    small = small or {}
    target = write_config(target_dir, {**QWEN3_8B, **SMOLLM2_VOCAB, **small})
    dflash = {**QWEN3_8B_DFLASH["dflash_config"], "mask_token_id": 8, "mask_token": "<issue_start>"}
    drafter = {**QWEN3_8B_DFLASH, **SMOLLM2_VOCAB, "dflash_config": dflash}
    if small:
        dflash["target_layer_ids"] = [0, small["num_hidden_layers"] - 1]
        drafter.update(small, num_hidden_layers=1, num_target_layers=small["num_hidden_layers"])
    return target, write_config(drafter_dir, drafter)
