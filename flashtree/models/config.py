"""ModelConfig: the target-model hyperparameters flashtree's decoder needs, parsed from a
Hugging Face ``config.json`` dict (either the older or the newer transformers layout).

Supported families (``model_type``): ``llama`` (Llama 2/3.x incl. ``llama3`` rope scaling,
SmolLM2), ``qwen2`` (qkv bias), ``qwen3`` (per-head q/k RMSNorm), ``qwen3_moe`` (Qwen3 attention,
sparse mixture-of-experts MLPs: ``models/moe.py``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from flashtree.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_ARCHITECTURE_TO_TYPE = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Qwen3-MoE routing: which layers are sparse and how tokens pick experts."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False  # renormalize the chosen experts' weights to sum 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                              f"got {self.num_experts_per_tok}")

    def sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """``llama3`` frequency scaling (Llama 3.1+). ``rope_type == "default"`` means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # qwen3_moe: the experts and their routing

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a Hugging Face config dict; ``source`` names the file in error messages."""
        try:
            return _parse(raw)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        except KeyError as err:
            raise ConfigError(f"{source}: required key {err.args[0]!r} is missing") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config.json not found (a model directory needs one)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None
        return cls.from_dict(raw, source=str(path))


def _model_type(raw: Mapping[str, Any]) -> str:
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    for arch in raw.get("architectures") or ():
        if arch in _ARCHITECTURE_TO_TYPE:
            return _ARCHITECTURE_TO_TYPE[arch]
    raise ConfigError(
        f"unsupported architecture: model_type={model_type!r}, architectures={raw.get('architectures')!r}; "
        f"allowed model_type: {', '.join(SUPPORTED_MODEL_TYPES)} "
        f"(architectures: {', '.join(_ARCHITECTURE_TO_TYPE)})"
    )


def rope_settings(raw: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """``rope_theta`` and scaling from either layout: top-level ``rope_theta`` +
    ``rope_scaling``, or the newer ``rope_parameters: {rope_theta, rope_type, ...}``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    merged = {**scaling, **{k: v for k, v in params.items() if k != "rope_theta"}}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return float(theta), RopeScaling()
    if rope_type != "llama3":
        raise ConfigError(f"rope type {rope_type!r} is not supported; allowed: default, llama3")
    return float(theta), RopeScaling(
        rope_type="llama3",
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _parse(raw: Mapping[str, Any]) -> ModelConfig:
    model_type = _model_type(raw)
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    theta, scaling = rope_settings(raw)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        moe=_moe(raw) if model_type == "qwen3_moe" else None,
    )


def _moe(raw: Mapping[str, Any]) -> MoeConfig | None:
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)  # (newer transformers' name)
    if not experts:
        return None
    return MoeConfig(num_experts=experts, num_experts_per_tok=int(raw["num_experts_per_tok"]),
                     moe_intermediate_size=int(raw["moe_intermediate_size"]),
                     norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                     decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
                     mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()))
