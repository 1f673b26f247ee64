"""CPU block kernel with int8 activations (kernels/cpu/kernels.cpp, ``QuantizedLinear(int8_activations=True)``):
each row of x rounded per 32 values to ``q = round(x / d)``, ``d = max|x| / 127``, then exact integer block
dot products scaled in float. Checked against a float64 reference of exactly that arithmetic (x rounded
the same way in torch), row for row whatever the row count, bit-identical between the AVX-512 VNNI and
the AVX2 builds, and plumbed from the config and CLI to the model's holders and layer stack. The error
against the float path on a real layer: tests/integration/test_cpu_int8_activations.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from flashtree import LLM
from flashtree.config import EngineConfig
from flashtree.kernels.cpu import library as cpu_library
from flashtree.kernels.cpu.library import kernels_available
from flashtree.kernels.cpu.quant_linear import INT8_ACTIVATIONS, QuantizedLinear
from tests.support.checkpoints import holders, isolated_cache, tiny_gguf  # noqa: F401 (autouse fixture)
from tests.support.cpu_builds import (
    assert_avx2_build_gives_the_same_bits,
    assert_rows_independent_of_the_call,
    rounded_rows,
)

AVAILABLE, WHY = kernels_available()
needs_kernel = pytest.mark.skipif(not AVAILABLE, reason=f"CPU block kernel unavailable: {WHY}")
UNIT_ROUNDOFF = 2.0 ** -24  # float32


def random_blocks(rows: int, cols: int, type_name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF blocks of random weights (the gguf package's quantizer) [N, K / 32 * bytes] and their fp32 [N, K]."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    dense = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(rows, cols)
    return torch.from_numpy(np.array(data).reshape(rows, -1)), torch.from_numpy(dense)


def block_slack(blocks: torch.Tensor, type_name: str, cols: int) -> torch.Tensor:
    """Per weight [N, K]: what a lane's integer terms add to |w| (Q4_0: the -8 sum(q) term spread over
    the lanes, 9 |d| bounds it with the nibble offset; Q4_1: the min term, 2 |m|; Q8_0: nothing)."""
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    raw = blocks.reshape(blocks.shape[0], cols // 32, block_bytes)  # [N, B, bytes]
    if type_name == "Q8_0":
        return torch.zeros(blocks.shape[0], cols, dtype=torch.float64)
    at = 0 if type_name == "Q4_0" else 2  # the scale d, or Q4_1's min m
    half = raw[..., at:at + 2].contiguous().view(torch.float16).float()[..., 0].abs()  # [N, B]
    slack = 9 * half if type_name == "Q4_0" else 2 * half
    return slack.repeat_interleave(32, dim=1).double()  # [N, K]


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(32, 32), (96, 576), (200, 1536), (70, 96)])
def test_int8_products_equal_their_integer_reference(type_name, shape):
    """y = x_rounded @ W.T + bias (float64) up to float32 rounding: the kernel rounds each s = d_w d once,
    then per lane a chain of at most 2 * blocks fmas, 3 lane sums and the bias add; each adds at most one
    unit roundoff of the magnitudes summed, which are at most sum |x_rounded| (|w| + slack) + |bias|."""
    blocks, dense = random_blocks(*shape, type_name, seed=shape[0] + 7)
    holder = QuantizedLinear(type_name, blocks, shape[1], int8_activations=True)
    assert holder.kernel_code == holder.type_code | INT8_ACTIVATIONS
    torch.manual_seed(2)
    bias = torch.randn(shape[0])
    magnitude = dense.abs().double() + block_slack(blocks, type_name, shape[1])  # [N, K]
    steps = 2 * shape[1] // 32 + 6
    for rows in (1, 2, 3, 5, 8, 9, 17, 33):
        x = torch.randn(rows, shape[1]) * torch.rand(rows, 1) * 4  # rows of different scales
        xr = rounded_rows(x)
        want = xr @ dense.double().T + bias.double()
        bound = steps * UNIT_ROUNDOFF * (xr.abs() @ magnitude.T + bias.abs().double())
        got = holder(x, bias)
        assert ((got.double() - want).abs() <= bound).all(), (rows, (got.double() - want).abs().max().item())
        # and it is not the float product: x was rounded (the difference is far above float rounding)
        assert (got.double() - (x.double() @ dense.double().T + bias.double())).abs().max() > bound.max()


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_row_gets_the_same_bits_whatever_shares_the_call(type_name):
    """Rows are rounded one by one and every (row, column) pair runs one chain: a row's result is the
    same alone, in a decode-sized call, and in a prefill-sized one (groups of 8 rows, or 4 for wide rows)."""
    for shape in ((96, 576), (200, 4608)):
        blocks, _ = random_blocks(*shape, type_name, seed=shape[1])
        holder = QuantizedLinear(type_name, blocks, shape[1], int8_activations=True)
        torch.manual_seed(3)
        bias = torch.randn(shape[0])
        assert_rows_independent_of_the_call(holder, torch.randn(45, shape[1]), bias, (2, 7, 8, 13, 45))


@needs_kernel
def test_zero_and_single_value_blocks():
    """An all-zero block of x (scale 0) adds nothing and no NaN; a block holding one value rounds it to
    +-127 d, exactly itself; a zero row gives the bias exactly."""
    blocks, dense = random_blocks(64, 128, "Q8_0", seed=5)
    holder = QuantizedLinear("Q8_0", blocks, 128, int8_activations=True)
    bias = torch.randn(64)
    assert torch.equal(holder(torch.zeros(3, 128), bias), bias.expand(3, 64))
    x = torch.zeros(1, 128)
    x[0, 40], x[0, 100] = 3.5, -0.25  # blocks 1 and 3 hold one value each; blocks 0 and 2 are zero
    want = x.double() @ dense.double().T
    torch.testing.assert_close(holder(x).double(), want, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.skipif("avx2" not in cpu_library.cpu_flags(), reason="needs an AVX2 CPU")
def test_avx2_build_gives_the_same_bits(monkeypatch):
    """The AVX2 build (vpmaddubsw + vpmaddwd, the same per-lane integer sums as VNNI's vpdpbusd, and the
    same 256-bit float steps) gives the bits of the build this CPU picks."""
    cases = []
    for type_name, shape in (("Q4_0", (70, 576)), ("Q4_1", (96, 1536)), ("Q8_0", (200, 64))):
        blocks, _ = random_blocks(*shape, type_name, seed=11)
        cases.append((type_name, blocks, torch.randn(21, shape[1])))
    assert_avx2_build_gives_the_same_bits(monkeypatch, cases, int8_activations=True)


def test_vnni_builds_are_picked_where_the_cpu_has_vnni():
    pick = cpu_library.isa_compiler_flags
    avx512 = {"avx512f", "avx512bw", "avx2", "f16c", "fma"}
    assert pick(avx512 | {"avx512vl", "avx512_vnni"}) == ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
    assert pick(avx512 | {"avx512_vnni"}) == ("-mavx512f", "-mavx512bw")  # no avx512vl: no 256-bit VNNI
    assert pick({"avx2", "avx_vnni", "f16c", "fma"}) == ("-mavx2", "-mavxvnni")


@needs_kernel
def test_switch_reaches_the_holders_and_the_layer_stack(tmp_path):
    from flashtree.cli import build_parser
    from flashtree.cli.serve import config_from_args

    assert EngineConfig.of().kernels.int8_activations is True
    parser = build_parser()
    assert parser.parse_args(["generate", "--prompt", "x"]).int8_activations is True
    assert parser.parse_args(["generate", "--prompt", "x", "--no-int8-activations"]).int8_activations is False
    assert config_from_args(parser.parse_args(["serve", "--no-int8-activations"])).engine.kernels.int8_activations \
        is False
    path = str(tiny_gguf(tmp_path / "tiny.gguf"))
    for flag in (True, False):
        model = LLM(path, device="cpu", max_running=1, max_context=64, int8_activations=flag).engine.model
        assert all(h.int8_activations is flag for h in holders(model))
        codes = model.layer_stack.table[:, 4::2]  # [L, 4]: the products' kernel codes
        assert torch.equal(codes, torch.tensor([[h.kernel_code for h in holders(model)[1 + 4 * i:5 + 4 * i]]
                                                for i in range(model.config.num_hidden_layers)]))
        assert bool((codes & INT8_ACTIVATIONS).all()) is flag and bool((codes & INT8_ACTIVATIONS).any()) is flag
