"""The CPU block kernel (kernels/cpu/kernels.cpp) on Q5_0, Q5_1, Q4_K and Q6_K blocks.

Decoding rebuilds every weight bit-identical to gguf-py's (the converter's) float32 weights and to the
independent decoders of tests/support/kquants.py; float-activation products match a float64 product of
those weights, int8-activation products a float64 product with x rounded as the kernel rounds it, each
within a bound derived from the kernel's float steps; a row's bits never depend on the rows beside it;
the AVX2 build gives the int8 products' bits of the build this CPU picks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from flashtree.kernels.cpu import library as cpu_library
from flashtree.kernels.cpu.library import kernels_available
from flashtree.kernels.cpu.quant_linear import BLOCK_TYPES, QuantizedLinear
from tests.support.cpu_builds import (
    assert_avx2_build_gives_the_same_bits,
    assert_rows_independent_of_the_call,
    rounded_rows,
)
from tests.support.kquants import (
    decode_q4_k,
    decode_q6_k,
    quantize_q4_k,
    quantize_q6_k,
    random_blocks,
)

AVAILABLE, WHY = kernels_available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=f"CPU block kernel unavailable: {WHY}")
UNIT_ROUNDOFF = 2.0 ** -24  # float32
TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q6_K"]
SHAPES = [(40, 256), (33, 768), (70, 1536)]  # whole super-blocks (K a multiple of 256)


def blocks_and_weights(rows: int, cols: int, type_name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random valid blocks ``uint8 [N, row bytes]`` and gguf-py's float32 weights ``[N, K]`` of them."""
    qtype = QT[type_name]
    raw = random_blocks(rows, cols, qtype, np.random.default_rng(seed), scale=0.05)
    dense = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(rows, cols)
    return torch.from_numpy(raw), torch.from_numpy(dense)


def _fp16(raw: torch.Tensor, at: int) -> torch.Tensor:
    return raw[..., at:at + 2].contiguous().view(torch.float16).double()[..., 0]


def int8_slack(blocks: torch.Tensor, type_name: str, cols: int) -> torch.Tensor:
    """Per weight [N, K]: a bound on what the integer terms of a block's lanes add to |w| in magnitude.
    Q5_0's lanes hold sum(q q_x) - 16 sum(q_x) with q in 0..31: |d| (q + 16) <= |w| + 32 |d|; Q5_1 and
    Q4_K add the min term apart: |d q| <= |w| + |m|, and the min term |m| again; Q6_K's terms are w x."""
    rows = blocks.shape[0]
    if type_name == "Q6_K":
        return torch.zeros(rows, cols, dtype=torch.float64)
    if type_name == "Q4_K":
        raw = blocks.reshape(rows, cols // 256, 144)
        dmin = _fp16(raw, 2)  # [N, S]
        _, mins = _scale_min(raw[..., 4:16])  # [N, S, 8]
        return (2 * dmin[..., None] * mins).repeat_interleave(32, dim=-1).reshape(rows, cols)
    raw = blocks.reshape(rows, cols // 32, BLOCK_TYPES[type_name].block_bytes)
    slack = 32 * _fp16(raw, 0).abs() if type_name == "Q5_0" else 2 * _fp16(raw, 2).abs()  # [N, B]
    return slack.repeat_interleave(32, dim=1)


def _scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.support.kquants import _q4_k_scales

    scales, mins = _q4_k_scales(packed.numpy())
    return torch.from_numpy(scales).double(), torch.from_numpy(mins).double()


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decoding_is_bit_identical_to_gguf_py(type_name, shape):
    blocks, dense = blocks_and_weights(*shape, type_name, seed=shape[1] + 1)
    holder = QuantizedLinear(type_name, blocks, shape[1])
    assert torch.equal(holder.dequantize(), dense)
    picked = torch.tensor([shape[0] - 1, 0, 3])
    assert torch.equal(holder.dequantize(picked), dense[picked])


@pytest.mark.parametrize("type_name, decoder, encoder", [("Q4_K", decode_q4_k, quantize_q4_k),
                                                         ("Q6_K", decode_q6_k, quantize_q6_k)])
def test_decoding_matches_the_independent_decoder(type_name, decoder, encoder):
    """Random blocks and blocks encoded from weights, read by tests/support/kquants.py's own decoder."""
    blocks, _ = blocks_and_weights(24, 512, type_name, seed=4)
    assert torch.equal(QuantizedLinear(type_name, blocks, 512).dequantize(),
                       torch.from_numpy(decoder(blocks.numpy(), 512)))
    weight = np.random.default_rng(5).standard_normal((16, 768)).astype(np.float32) * 0.1
    encoded = encoder(weight)
    decoded = QuantizedLinear(type_name, torch.from_numpy(encoded), 768).dequantize()
    assert torch.equal(decoded, torch.from_numpy(decoder(encoded, 768)))
    assert (decoded - torch.from_numpy(weight)).abs().max() < 0.05  # the encoding is of the weights


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_float_products_equal_the_float64_product(type_name, shape):
    """y = x @ W.T + bias up to float32 rounding: each product w x is exact; per lane a chain of at most
    2 * blocks fmas (AVX2's single accumulator), at most 5 lane and accumulator sums and the bias add,
    each adding at most one unit roundoff of the sum of |w x| + |bias|."""
    blocks, dense = blocks_and_weights(*shape, type_name, seed=shape[0])
    holder = QuantizedLinear(type_name, blocks, shape[1])
    torch.manual_seed(1)
    bias = torch.randn(shape[0])
    steps = 2 * shape[1] // 32 + 6
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, shape[1]) * 2
        want = x.double() @ dense.double().T + bias.double()
        bound = 1.01 * steps * UNIT_ROUNDOFF * (x.double().abs() @ dense.double().abs().T + bias.double().abs())
        got = holder(x, bias).double()
        assert ((got - want).abs() <= bound).all(), (rows, (got - want).abs().max().item())


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_products_equal_their_integer_reference(type_name, shape):
    """y = x_rounded @ W.T + bias (float64) up to float32 rounding: each term's scale d_w d is rounded
    once, then per lane a chain of at most one fma per block (two a pair: Q6_K's two halves, or the
    min term), 3 lane sums and the bias add, each at most one unit roundoff of sum |x_r| (|w| + slack)."""
    blocks, dense = blocks_and_weights(*shape, type_name, seed=shape[0] + 7)
    holder = QuantizedLinear(type_name, blocks, shape[1], int8_activations=True)
    torch.manual_seed(2)
    bias = torch.randn(shape[0])
    magnitude = dense.abs().double() + int8_slack(blocks, type_name, shape[1])  # [N, K]
    steps = shape[1] // 32 + 6
    for rows in (1, 2, 5, 9, 17):
        x = torch.randn(rows, shape[1]) * torch.rand(rows, 1) * 4  # rows of different scales
        xr = rounded_rows(x)
        want = xr @ dense.double().T + bias.double()
        bound = 1.01 * steps * UNIT_ROUNDOFF * (xr.abs() @ magnitude.T + bias.abs().double())
        got = holder(x, bias).double()
        assert ((got - want).abs() <= bound).all(), (rows, (got - want).abs().max().item())
        # and it is not the float product: x was rounded (far above float rounding)
        assert (got - (x.double() @ dense.double().T + bias.double())).abs().max() > bound.max()


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("int8", [False, True])
def test_a_row_gets_the_same_bits_whatever_shares_the_call(type_name, int8):
    for shape in ((96, 512), (70, 4608)):  # 4608: groups of 4 rows for float x (8 would not fit in L1)
        blocks, _ = blocks_and_weights(*shape, type_name, seed=shape[1])
        holder = QuantizedLinear(type_name, blocks, shape[1], int8_activations=int8)
        torch.manual_seed(3)
        bias = torch.randn(shape[0])
        assert_rows_independent_of_the_call(holder, torch.randn(21, shape[1]), bias, (2, 7, 8, 13, 21))


def test_q5_odd_block_count():
    """A row of an odd number of 32-weight blocks (the int8 path pairs blocks: the last one alone)."""
    for type_name in ("Q5_0", "Q5_1"):
        blocks, dense = blocks_and_weights(9, 96, type_name, seed=9)
        x = torch.randn(3, 96)
        for int8 in (False, True):
            got = QuantizedLinear(type_name, blocks, 96, int8_activations=int8)(x).double()
            want = (rounded_rows(x) if int8 else x.double()) @ dense.double().T
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_super_block_types_need_whole_super_blocks():
    blocks, _ = blocks_and_weights(4, 256, "Q4_K", seed=1)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedLinear("Q4_K", blocks[:, :72], 128)
    with pytest.raises(ValueError, match="Q4_K blocks of shape"):
        QuantizedLinear("Q4_K", blocks, 512)


@pytest.mark.skipif("avx2" not in cpu_library.cpu_flags(), reason="needs an AVX2 CPU")
def test_avx2_build_gives_the_same_int8_bits(monkeypatch):
    """The AVX2 build (vpmaddubsw + vpmaddwd) gives the int8 products' bits of the build this CPU picks."""
    cases = []
    for type_name, shape in (("Q5_0", (70, 544)), ("Q5_1", (96, 1536)), ("Q4_K", (40, 768)), ("Q6_K", (33, 512))):
        blocks, _ = blocks_and_weights(*shape, type_name, seed=11)
        cases.append((type_name, blocks, torch.randn(13, shape[1])))
    assert_avx2_build_gives_the_same_bits(monkeypatch, cases, int8_activations=True)


@pytest.mark.parametrize("int8", [False, True])
def test_a_mixed_product_is_its_parts_side_by_side(int8):
    """Q4_K_M's fused q/k/v: Q4_K parts and a Q6_K part, each computed by its own type's kernel; the
    outputs (and the bias) are the parts' own, bit for bit, whatever the row count."""
    from flashtree.kernels.cpu.quant_linear import MIXED_PARTS, MixedQuantizedLinear

    parts = [QuantizedLinear(t, blocks_and_weights(n, 512, t, seed=n)[0], 512, int8_activations=int8)
             for t, n in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32), ("Q5_0", 8))]
    mixed = MixedQuantizedLinear(parts, int8_activations=int8)
    assert mixed.kernel_code == MIXED_PARTS | (16 if int8 else 0) and mixed.out_features == 136
    assert mixed.blocks.numel() == sum(p.blocks.numel() for p in parts)  # one storage holds every part
    torch.manual_seed(4)
    bias = torch.randn(136)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 512)
        want = torch.cat([p(x, bias[a:a + p.out_features]) for p, a in zip(parts, (0, 64, 96, 128))], dim=-1)
        assert torch.equal(mixed(x, bias), want), rows
        assert torch.equal(mixed(x), torch.cat([p(x) for p in parts], dim=-1))
    picked = torch.tensor([135, 0, 70, 100, 96, 5])
    whole = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(mixed.dequantize(), whole) and torch.equal(mixed.dequantize(picked), whole[picked])
    with pytest.raises(ValueError, match="one width"):
        MixedQuantizedLinear([parts[0], QuantizedLinear("Q4_K", blocks_and_weights(4, 256, "Q4_K", seed=1)[0], 256)])


def test_the_loader_reads_a_mixed_group_as_per_type_parts():
    """read_groups: a fused group whose matrices differ in type becomes a mixed product checked against
    its float weights; one whose blocks differ from the weights is refused."""
    from flashtree.kernels.cpu.library import KernelUnavailable
    from flashtree.kernels.cpu.quant_linear import MixedQuantizedLinear
    from flashtree.models.gguf_blocks import StoredMatrix
    from flashtree.models.quantized_weights import BlockGroup, read_groups

    group = BlockGroup("attn", "qkv_quant", "qkv_weight", ("q.weight", "k.weight", "v.weight"), ("q", "k", "v"))
    raw = {"q": blocks_and_weights(16, 256, "Q4_K", seed=1), "k": blocks_and_weights(8, 256, "Q4_K", seed=2),
           "v": blocks_and_weights(8, 256, "Q6_K", seed=3)}
    types = {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K"}
    stored = {name: StoredMatrix(types[name], *blocks.shape, lambda out, b=blocks: out.copy_(b))
              for name, (blocks, _) in raw.items()}
    weights = {f"{name}.weight": dense for name, (_, dense) in raw.items()}
    quant = read_groups([group], stored, weights)[group]
    assert isinstance(quant, MixedQuantizedLinear) and [p.type_name for p in quant.parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert torch.equal(quant.dequantize(), torch.cat([weights["q.weight"], weights["k.weight"], weights["v.weight"]]))
    weights["v.weight"] = weights["v.weight"] + 1
    with pytest.raises(KernelUnavailable, match="differ"):
        read_groups([group], stored, weights)


def test_a_blocks_file_collected_for_fewer_types_is_not_reused(tmp_path):
    """gguf_blocks.safetensors written before the kernel read Q5 / k-quant blocks lacks them: it is stale
    (load_blocks then collects the GGUF's matrices again), one written now is read back."""
    import json

    import safetensors.numpy

    from flashtree.models.gguf_blocks import BLOCKS_FILE, read_block_file, save_blocks

    source = {"path": "/x.gguf", "size": 1, "mtime_ns": 2}
    blocks = {"blk.0.attn_q.weight": ("Q4_K", blocks_and_weights(4, 256, "Q4_K", seed=1)[0].numpy())}
    save_blocks(blocks, tmp_path, source)
    found = read_block_file(tmp_path / BLOCKS_FILE, source)
    assert found["blk.0.attn_q.weight"].type_name == "Q4_K" and found["blk.0.attn_q.weight"].in_features == 256
    old = {"types": json.dumps({"t": "Q4_0"}), "source": json.dumps(["/x.gguf", 1, 2])}  # an older writer's
    safetensors.numpy.save_file({"t": np.zeros((2, 18), np.uint8)}, str(tmp_path / BLOCKS_FILE), metadata=old)
    assert read_block_file(tmp_path / BLOCKS_FILE, source) is None
