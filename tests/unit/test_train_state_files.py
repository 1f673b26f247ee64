"""Sharded tensor files (every file under its byte limit, big tensors cut into pieces, bit-exact
round trip in any dtype) and the --max-minutes deadline arithmetic."""

import torch

from flashtree.train.deadline import SAFETY, Deadline
from flashtree.train.tensor_shards import read_shards, write_shards


def test_shards_stay_under_the_limit_and_round_trip_bit_exact(tmp_path):
    limit = 256 * 1024
    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(300, 700, generator=g),  # 840 KB: cut into pieces
               "bf16": torch.randn(64, 64, generator=g).bfloat16(), "step": torch.tensor(17.0),
               "bytes": torch.randint(0, 255, (5056,), dtype=torch.uint8, generator=g),
               **{f"small/{i}": torch.randn(1000, generator=g) for i in range(100)}}
    index = write_shards(tmp_path, tensors, limit)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) > 4 and all(f.stat().st_size <= limit for f in files)
    assert len(index["big"]["parts"]) > 1 and len(index["step"]["parts"]) == 1
    back = read_shards(tmp_path, index)
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor), name


def test_deadline_leaves_room_for_the_next_step_and_the_finish():
    deadline = Deadline(limit_s=100.0, started_at=0.0, eval_batches=4)
    assert not deadline.should_stop(now=0.0)
    deadline.step_took(2.0)  # finishing then estimated: 4 eval batches x 2 s + 5 s for the save
    stop_at = 100.0 - SAFETY * (2.0 + 8.0 + 5.0)
    assert not deadline.should_stop(now=stop_at - 0.01) and deadline.should_stop(now=stop_at)
    deadline.eval_took(1.0)
    deadline.save_took(0.5)  # measured: the estimate shrinks
    assert not deadline.should_stop(now=stop_at) and deadline.should_stop(now=100.0 - SAFETY * 3.5)
