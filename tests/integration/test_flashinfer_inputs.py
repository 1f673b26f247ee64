"""benchmarks/gpu_flashinfer_attention.py hands FlashInfer's paged prefill a tree verify as indptrs, page ids and a
flattened custom mask: read back by a plain attention, those inputs give the engine's attention of the same forward
(committed context visible, the tree by its mask) for every forward kind the benchmark times."""

import sys
from pathlib import Path


def test_flashinfer_inputs_describe_the_engines_attention():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu_flashinfer_attention import check_inputs

    diffs = check_inputs()
    assert set(diffs) == {"plain", "ddtree4", "dflash16", "ddtree16", "ddtree64", "drafter16"}
    assert max(diffs.values()) < 1e-4, diffs
