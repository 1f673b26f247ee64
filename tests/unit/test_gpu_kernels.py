"""Without CUDA (and outside Triton's interpreter) the fused Triton kernels stay off."""

import os

from tests.helpers import ours_from_hf, tiny_hf_model


def test_kernels_stay_off_without_cuda_or_interpreter():
    model = ours_from_hf(tiny_hf_model("qwen3_qknorm"))
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not model.use_gpu_kernels()
        assert not model.fused_kernels
