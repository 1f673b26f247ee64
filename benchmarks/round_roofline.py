"""The roofline of a decoding round (../shared/DESIGN.md section 10), from the model configs.

A forward of N tokens through P matmul parameters costs at least max(2P bytes / BW, 2PN / PEAK);
attention adds the bytes of the K/V it reads. A round is the target's verify forward plus the
drafter's forward, each judged by its own token count:

- plain: N = rows (one token a row), no drafter;
- DFlash: N = rows x block (the anchor and the block's drafts), the drafter N = rows x block;
- DDTree-B: N = rows x (B + 1) (the tree's nodes and its root), the drafter as DFlash's.

The drafter's context tokens (its K/V of accepted tokens, a few a round) are left out. BW and PEAK
are the effective figures of DESIGN.md for the H200 (4.2 TB/s, 780 TFLOP/s); the H100's bandwidth is
scaled by the two cards' nominal HBM figures (3.35 / 4.8 TB/s), its PEAK taken equal (the same GH100
compute): a projection, named as one in the results.
"""

from dataclasses import dataclass

BYTES_PER_PARAM = 2  # bf16


@dataclass(frozen=True)
class Machine:
    name: str
    bandwidth: float  # bytes/s, effective
    peak: float  # FLOP/s, effective dense bf16
    projected: bool


H200 = Machine("H200", 4.2e12, 780e12, projected=False)
H100 = Machine("H100 (projected from the H200's figures)", 4.2e12 * 3.35 / 4.8, 780e12, projected=True)


def machine_of(device_name: str) -> Machine:
    return H100 if "H100" in device_name else H200


def matmul_params(config: dict) -> int:
    """Parameters every token multiplies through: the layers' products and the LM head (and a
    drafter's fc over its target layers' features)."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config["intermediate_size"]
    fc = len(config["dflash_config"]["target_layer_ids"]) * h * h if "dflash_config" in config else 0
    return layers * per_layer + fc + config["vocab_size"] * h


def kv_bytes_per_token(config: dict) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * BYTES_PER_PARAM


def forward_floor_s(params: int, tokens: int, machine: Machine) -> float:
    return max(params * BYTES_PER_PARAM / machine.bandwidth, 2 * params * tokens / machine.peak)


def verified_tokens(method: str, block: int) -> int:
    """Target tokens a row verifies per round: ``none`` 1, ``dflash`` the block, ``ddtree:B`` B + 1, ``ddtree:B@N``
    (rounds of N nodes a row, gpu_rounds.py) N + 1."""
    name, _, sizes = method.partition(":")
    budget, _, option = sizes.partition("@")
    return {"none": 1, "dflash": block}.get(name) or int(option or budget) + 1


def round_floor_ms(method: str, rows: int, context: int, target: dict, drafter: dict,
                   machine: Machine) -> dict:
    """The round's floor (ms) and its parts: target forward, drafter forward, K/V reads."""
    block = drafter["block_size"]
    target_s = forward_floor_s(matmul_params(target), rows * verified_tokens(method, block), machine)
    drafter_s = 0.0 if method == "none" else forward_floor_s(matmul_params(drafter), rows * block, machine)
    kv_tokens = rows * context
    kv_s = kv_tokens * (kv_bytes_per_token(target) + (0 if method == "none" else kv_bytes_per_token(drafter)))
    kv_s /= machine.bandwidth
    return {"floor_ms": (target_s + drafter_s + kv_s) * 1e3, "target_ms": target_s * 1e3,
            "drafter_ms": drafter_s * 1e3, "kv_read_ms": kv_s * 1e3}
