"""GGUF -> Hugging Face layout: dequantize a ``.gguf`` file once into a cached directory.

A GGUF file carries the weights (possibly quantized, with llama.cpp tensor names), the
hyperparameters (``{arch}.*`` metadata) and the tokenizer (``tokenizer.*`` metadata). The
rest of flashtree only reads Hugging Face directories, so :func:`convert_gguf` writes

    $FLASHTREE_CACHE/gguf/<stem>-<key>/   (FLASHTREE_CACHE defaults to ~/.cache/flashtree)
        config.json         Hugging Face config built from the GGUF metadata
        model.safetensors   every tensor dequantized to float32, Hugging Face names (numbered shards
                            and model.safetensors.index.json past SHARD_BYTES: written as converted)
        gguf_blocks.safetensors  the Q4_0/Q4_1/Q8_0 matrices' raw blocks, GGUF names, q/k rows
                            un-permuted (for the CPU block kernel, gguf_blocks.py)
        tokenizer.json ...  the GGUF tokenizer, saved with ``save_pretrained``

``key`` hashes the file's absolute path, size and mtime, so an edited or replaced file is
converted again. The directory is built under a temporary name and renamed into place, so
an interrupted conversion never leaves a half-written cache entry.

A Qwen3-MoE GGUF (``qwen3moe``) stacks each layer's experts in one tensor per projection
(``blk.N.ffn_{gate,up,down}_exps``, ``[experts, rows, columns]``): they are not converted (they are
nearly all of the model), the loader reads them from the GGUF per expert (``gguf_experts.py``); the
router ``blk.N.ffn_gate_inp`` becomes ``mlp.gate``.

Two llama.cpp conventions are undone here:
- for the ``llama`` architecture, llama.cpp's converter permutes the rows of ``attn_q`` and
  ``attn_k`` (per head, from "first half / second half" rotary pairs to interleaved pairs);
  :mod:`gguf_layout` restores Hugging Face's order. Qwen2/Qwen3 are not permuted.
- Llama 3.1 rope scaling is stored as a ``rope_freqs`` tensor of per-frequency divisors;
  :func:`llama3_rope_scaling` turns it back into a ``rope_scaling: {rope_type: llama3}`` dict.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import safetensors.torch
import torch

from flashtree.errors import CheckpointError, ConfigError
from flashtree.models.config import ModelConfig
from flashtree.models.gguf_blocks import gguf_blocks, save_blocks
from flashtree.models.gguf_experts import EXPERT_PROJECTIONS, expert_tensor_names
from flashtree.models.gguf_layout import unpermute_for_hf
from flashtree.paths import cache_root as default_cache_root

SUPPORTED_ARCHITECTURES = {  # GGUF general.architecture -> Hugging Face architectures entry
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
_MODEL_TYPES = {"qwen3moe": "qwen3_moe"}  # GGUF architecture -> Hugging Face model_type, where they differ
_SOFTMAX_GATING = 1  # llama.cpp's expert_gating_func for a softmax over the router logits
# what gguf-py dequantizes (its numpy implementations follow ggml's): the float types, the legacy
# 32-weight blocks, the k-quants of 256-weight super-blocks (Q4_K_M files mix Q4_K and Q6_K) and the
# non-linear 4-bit codebooks; on the CPU the types of quant_linear.BLOCK_TYPES run from their blocks
# (gguf_blocks.py), the rest from their float32 dequantization
SUPPORTED_TENSOR_TYPES = tuple(
    gguf.GGMLQuantizationType[name] for name in (
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
)
SHARD_BYTES = 2 << 30  # float32 bytes a converted shard holds at most: the conversion's peak memory beyond the file
_CACHE_FORMAT_VERSION = 2  # bump when the converted layout changes: old entries are ignored
_ROPE_FREQS_TENSOR = "rope_freqs.weight"
_LLAMA3_ORIGINAL_CONTEXT = 8192  # any value gives identical frequencies, see llama3_rope_scaling

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


def cache_dir_for(gguf_path: Path, cache_root: Path) -> Path:
    """The cache entry of ``gguf_path``: keyed by absolute path, size and mtime."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    identity = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}\0v{_CACHE_FORMAT_VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: Path, cache_root: Path | None = None) -> Path:
    """Return the Hugging Face directory for ``gguf_path``, converting it on first use."""
    gguf_path = gguf_path.resolve()
    target = cache_dir_for(gguf_path, cache_root or default_cache_root())
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        write_converted(gguf_path, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; a cache entry is an ordinary directory
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_converted(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, the float32 weights and the tokenizer of ``gguf_path`` to ``out_dir``."""
    reader = _open_reader(gguf_path)
    config = checked_config(reader, gguf_path)
    write_weights(converted_tensors(reader, config, gguf_path), out_dir)
    save_tokenizer(reader, gguf_path, out_dir)
    _save_quantized_blocks(reader, config, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_weights(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Path, shard_bytes: int | None = None) -> None:
    """Save ``tensors`` as they come, in shards of at most ``shard_bytes`` (default :data:`SHARD_BYTES`;
    a bigger tensor gets a shard of its own), so a conversion holds one shard in memory, not the
    model: ``model.safetensors`` when one shard holds everything, else Hugging Face's numbered shards
    and ``model.safetensors.index.json``."""
    limit = shard_bytes or SHARD_BYTES
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        safetensors.torch.save_file(current, str(out_dir / f".shard-{len(shards)}"), metadata={"format": "pt"})
        shards.append(list(current))

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            flush()
            current, size = {}, 0
        current[name] = tensor
        size, total = size + nbytes, total + nbytes
    flush()
    if len(shards) == 1:
        (out_dir / ".shard-0").rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / f".shard-{i}").rename(out_dir / file_name)
        weight_map.update(dict.fromkeys(names, file_name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _save_quantized_blocks(reader: gguf.GGUFReader, config: dict[str, Any], out_dir: Path) -> None:
    """Keep the Q4_0 / Q4_1 / Q8_0 blocks too, for the CPU block kernel (gguf_blocks.py)."""
    blocks = gguf_blocks(reader, config["model_type"], config["num_attention_heads"], config["num_key_value_heads"])
    if blocks:
        save_blocks(blocks, out_dir, config["flashtree_source_gguf"])


def _open_reader(gguf_path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError) as err:
        raise CheckpointError(
            f"{gguf_path}: not a readable GGUF file, it is truncated or corrupt ({type(err).__name__}: {err}); re-download it"
        ) from err


def checked_config(reader: gguf.GGUFReader, gguf_path: Path) -> dict[str, Any]:
    """The Hugging Face config of a GGUF file whose architecture and tensor types flashtree reads."""
    _architecture(reader, gguf_path)
    _check_tensor_types(reader, gguf_path)
    config = gguf_config(reader, gguf_path)
    ModelConfig.from_dict(config, source=str(gguf_path))  # fail before the slow part
    if any(expert_tensor_names(tensor.name) for tensor in reader.tensors):
        config["flashtree_source_gguf"]["experts_in_gguf"] = True  # (gguf_experts.py)
    return config


def converted_tensors(reader: gguf.GGUFReader, config: dict[str, Any], gguf_path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the file dequantized to float32, renamed and un-permuted to Hugging Face's layout,
    one at a time; a MoE layer's experts stay in the GGUF (read from it on demand: gguf_experts.py)."""
    arch = _architecture(reader, gguf_path)
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS_TENSOR or expert_tensor_names(tensor.name):
            continue  # folded into config["rope_scaling"]; read from the GGUF
        array = unpermute_for_hf(tensor.name, dequantize_tensor(tensor), arch,
                                 config["num_attention_heads"], config["num_key_value_heads"])
        yield hf_tensor_name(tensor.name, gguf_path), torch.from_numpy(array)


def _architecture(reader: gguf.GGUFReader, gguf_path: Path) -> str:
    arch = _metadata(reader, "general.architecture", gguf_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{gguf_path}: unsupported architecture: general.architecture={arch!r}; "
            f"allowed: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _check_tensor_types(reader: gguf.GGUFReader, gguf_path: Path) -> None:
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise CheckpointError(
                f"{gguf_path}: tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, which "
                f"flashtree cannot dequantize; allowed types: "
                f"{', '.join(t.name for t in SUPPORTED_TENSOR_TYPES)}"
            )


def dequantize_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A tensor as a float32 array of its logical shape (rows first, like PyTorch)."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions fastest first
    return np.array(array, dtype=np.float32, copy=True).reshape(shape)


def hf_tensor_name(gguf_name: str, gguf_path: Path) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` and so on."""
    if match := _BLOCK_TENSOR.match(gguf_name):
        layer, part, kind = match.groups()
        if part in _BLOCK_TENSOR_NAMES:
            return f"model.layers.{layer}.{_BLOCK_TENSOR_NAMES[part]}.{kind}"
    elif (match := _GLOBAL_TENSOR.match(gguf_name)) and match.group(1) in _GLOBAL_TENSOR_NAMES:
        return f"{_GLOBAL_TENSOR_NAMES[match.group(1)]}.{match.group(2)}"
    raise CheckpointError(
        f"{gguf_path}: tensor {gguf_name!r} has no Hugging Face equivalent; known: "
        f"{', '.join(_GLOBAL_TENSOR_NAMES)}, blk.N.{{{','.join([*_BLOCK_TENSOR_NAMES, *EXPERT_PROJECTIONS])}}}, "
        f"rope_freqs"
    )


def gguf_config(reader: gguf.GGUFReader, gguf_path: Path) -> dict[str, Any]:
    """A Hugging Face config.json dict from the GGUF metadata."""
    arch = _metadata(reader, "general.architecture", gguf_path)

    def arch_key(key: str, default: Any = ...) -> Any:
        return _metadata(reader, f"{arch}.{key}", gguf_path, default)

    tensor_names = {tensor.name for tensor in reader.tensors}
    hidden = int(arch_key("embedding_length"))
    heads = int(arch_key("attention.head_count"))
    head_dim = int(arch_key("attention.key_length", hidden // heads))
    rope_dim = int(arch_key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConfigError(
            f"{gguf_path}: {arch}.rope.dimension_count={rope_dim} (partial rotary) is not supported; "
            f"allowed: equal to the head dimension {head_dim}"
        )
    theta = _shortest_float32(arch_key("rope.freq_base", 10000.0))
    moe = _moe_config(arch_key, tensor_names, gguf_path) if arch in _MODEL_TYPES else {}
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": _vocab_size(reader, gguf_path),
        "hidden_size": hidden,
        "intermediate_size": int(arch_key("feed_forward_length", moe.get("moe_intermediate_size", ...))),
        "num_hidden_layers": int(arch_key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(arch_key("attention.head_count_kv", heads), gguf_path),
        "head_dim": head_dim,
        "rms_norm_eps": _shortest_float32(arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(arch_key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _metadata(reader, "tokenizer.ggml.bos_token_id", gguf_path, None),
        "eos_token_id": _eos_token_ids(reader, gguf_path),
        "dtype": "float32",
        "flashtree_source_gguf": _source_record(reader, gguf_path),
        **moe,
    }
    rope_scaling = _rope_scaling(reader, gguf_path, arch, theta, head_dim)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _moe_config(arch_key, tensor_names: set[str], gguf_path: Path) -> dict[str, Any]:
    """A Qwen3-MoE GGUF's routing in Hugging Face's keys. llama.cpp renormalizes the chosen experts'
    weights of ``qwen3moe`` (``norm_topk_prob``) unless ``expert_weights_norm`` says otherwise; a layer
    without ``ffn_gate_exps`` is dense (``mlp_only_layers``)."""
    gating = arch_key("expert_gating_func", _SOFTMAX_GATING)
    if int(gating) != _SOFTMAX_GATING:
        raise ConfigError(f"{gguf_path}: expert_gating_func={gating} is not supported; allowed: "
                          f"{_SOFTMAX_GATING} (softmax)")
    layers = int(arch_key("block_count"))
    return {
        "num_experts": int(arch_key("expert_count")),
        "num_experts_per_tok": int(arch_key("expert_used_count")),
        "moe_intermediate_size": int(arch_key("expert_feed_forward_length")),
        "norm_topk_prob": bool(arch_key("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in tensor_names],
    }


def _metadata(reader: gguf.GGUFReader, key: str, gguf_path: Path, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is not None:
        return field.contents()
    if default is ...:
        raise CheckpointError(f"{gguf_path}: GGUF metadata key {key!r} is missing")
    return default


def _shortest_float32(value: float) -> float:
    """GGUF stores float32: 1e-5 comes back as 9.99999974e-06; print it as config.json had it."""
    return float(str(np.float32(value)))


def _vocab_size(reader: gguf.GGUFReader, gguf_path: Path) -> int:
    """Rows of the embedding: the size of the token list unless the embedding is padded."""
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise CheckpointError(f"{gguf_path}: GGUF tensor 'token_embd.weight' is missing")
    rows = int(embedding.shape[-1])
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return len(tokens.data) if tokens is not None and len(tokens.data) == rows else rows


def _kv_heads(value: Any, gguf_path: Path) -> int:
    if isinstance(value, list):  # per-layer counts: fine only when all layers agree
        if len(set(value)) != 1:
            raise ConfigError(
                f"{gguf_path}: attention.head_count_kv differs per layer ({value}); allowed: one value"
            )
        value = value[0]
    return int(value)


def _eos_token_ids(reader: gguf.GGUFReader, gguf_path: Path) -> int | list[int] | None:
    """``eos_token_id`` plus the end-of-turn / end-of-message ids llama.cpp records."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _metadata(reader, f"tokenizer.ggml.{key}", gguf_path, None)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _source_record(reader: gguf.GGUFReader, gguf_path: Path) -> dict[str, Any]:
    stat = gguf_path.stat()
    return {
        "path": str(gguf_path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "name": _metadata(reader, "general.name", gguf_path, None),
        "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
    }


def _rope_scaling(
    reader: gguf.GGUFReader, gguf_path: Path, arch: str, theta: float, head_dim: int
) -> dict[str, Any] | None:
    scaling_type = _metadata(reader, f"{arch}.rope.scaling.type", gguf_path, None)
    if scaling_type not in (None, "none"):  # ModelConfig names what it supports
        factor = _metadata(reader, f"{arch}.rope.scaling.factor", gguf_path, 1.0)
        return {"rope_type": scaling_type, "factor": float(factor)}
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS_TENSOR), None)
    if freqs is None:
        return None
    return llama3_rope_scaling(dequantize_tensor(freqs), theta, head_dim, gguf_path)


def llama3_rope_scaling(
    divisors: np.ndarray, theta: float, head_dim: int, gguf_path: Path
) -> dict[str, Any] | None:
    """Recover Hugging Face's ``llama3`` rope_scaling from llama.cpp's ``rope_freqs`` tensor.

    Per frequency, llama.cpp stores 1 (short wavelengths), ``factor`` (long ones) or, in
    between, ``1 / ((1 - s) / factor + s)`` with ``s = (L / wavelength - low) / (high - low)``.
    ``s`` is linear in 1/wavelength, so two in-between points fix its slope ``L / (high - low)``
    and intercept; every choice of ``L`` then gives the same frequencies, so L = 8192."""
    divisors = divisors.astype(np.float64).reshape(-1)
    factor = float(divisors.max())
    if factor <= 1.0 + 1e-6:
        return None
    wavelength = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    between = (divisors > 1 + 1e-4) & (divisors < factor - 1e-4)
    if divisors.shape[0] != wavelength.shape[0] or between.sum() < 2:
        raise CheckpointError(
            f"{gguf_path}: cannot read {_ROPE_FREQS_TENSOR} ({divisors.shape[0]} values) as llama3 rope "
            f"scaling; allowed: head_dim/2 = {head_dim // 2} values with at least two between 1 and the factor"
        )
    smooth = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelength[between], smooth, 1)
    span = _LLAMA3_ORIGINAL_CONTEXT / slope
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(-intercept * span),
        "high_freq_factor": float((1 - intercept) * span),
        "original_max_position_embeddings": _LLAMA3_ORIGINAL_CONTEXT,
    }
    if not np.allclose(llama3_divisors(scaling, wavelength), divisors, rtol=1e-3, atol=1e-4):
        raise CheckpointError(f"{gguf_path}: {_ROPE_FREQS_TENSOR} does not follow llama3 rope scaling")
    return scaling


def llama3_divisors(scaling: dict[str, Any], wavelength: np.ndarray) -> np.ndarray:
    """The per-frequency divisors that ``llama3`` rope scaling applies (Hugging Face semantics)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    smooth = (context / wavelength - low) / (high - low)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelength < context / high, 1.0, divisors)
    return np.where(wavelength > context / low, factor, divisors)


def save_tokenizer(reader: gguf.GGUFReader, gguf_path: Path, out_dir: Path) -> None:
    """Convert the GGUF's tokenizer with transformers and save it; nothing if it has none."""
    if "tokenizer.ggml.model" not in reader.fields:
        return
    import transformers  # slow import: only when converting a tokenizer

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as err:  # transformers raises many types for unsupported tokenizers
        raise CheckpointError(
            f"{gguf_path}: transformers cannot convert this GGUF's tokenizer "
            f"(tokenizer.ggml.model={_metadata(reader, 'tokenizer.ggml.model', gguf_path)!r}): "
            f"{type(err).__name__}: {err}"
        ) from err
    template = _metadata(reader, "tokenizer.chat_template", gguf_path, None)
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
