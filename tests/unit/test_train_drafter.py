"""Drafter training's pieces: the training forward equals inference drafting, the flex-attention
mask rule equals the dense mask, loss weights and the tau estimate, the mask token choice. Training
runs, the trained drafter in the engine, resume and regenerate: tests/integration/test_train_drafter.py."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from flashtree.models.build import build_model
from flashtree.models.dflash import load_drafter
from flashtree.models.loader import load_checkpoint
from flashtree.train.anchors import build_blocks
from flashtree.train.config import loss_gamma
from flashtree.train.forward import training_hidden
from flashtree.train.loss import block_loss, correctness_stats
from flashtree.train.masks import block_mask_mod, dense_block_mask
from flashtree.train.new_drafter import choose_mask_token, spread_layer_ids
from flashtree.train.target_features import TargetFeatures
from tests.dflash_helpers import one_thread  # noqa: F401 (fixture)
from tests.support.train import pair  # noqa: F401 (fixture)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


def test_training_forward_equals_inference_drafting(pair):
    ckpt = load_checkpoint(str(pair.target))
    target = build_model(ckpt.config, ckpt.weights, torch.device("cpu"), torch.float32)
    drafter = load_drafter(str(pair.drafter), target, ckpt.tokenizer)
    cfg = drafter.config
    ids = torch.randint(0, 30, (1, 24), generator=torch.Generator().manual_seed(0))  # [1, N]
    features = TargetFeatures(target, cfg.target_layer_ids)(ids, torch.tensor([24]))  # [1, N, C]
    anchors = torch.tensor([[0, 5, 11, 12, 23]])  # every block of the sequence in one pass
    blocks = build_blocks(ids, torch.ones_like(ids, dtype=torch.bool), anchors, torch.ones_like(anchors).bool(),
                          cfg.block_size, cfg.mask_token_id)
    drafter.setup_rope(64)
    trained = drafter.target.head(training_hidden(drafter, features, blocks))  # [1, A, b-1, V]
    cache = drafter.new_cache(1, 64, 16)
    slot = torch.tensor([0])
    for a, start in enumerate(anchors[0].tolist()):
        cache.free(slot)  # inference: observe the committed context, then draft from the bonus token
        drafter.observe(cache, slot, features[:, :max(start, 1)], torch.tensor([start]), torch.tensor([0]))
        drafted = drafter.draft_logits(cache, slot, ids[:, start], torch.tensor([start]), kv_len=start + cfg.block_size)
        torch.testing.assert_close(trained[0, a], drafted[0], rtol=1e-5, atol=1e-5)


def test_flex_mask_rule_equals_dense_mask():
    positions = torch.tensor([[0, 3, 9, 9], [5, 1, 11, 2]])
    for window in (None, 3):
        dense = dense_block_mask(positions, 12, 4, window)
        flex = create_mask(block_mask_mod(positions, 12, 4, window), 2, 1, 16, 28, device="cpu")
        assert torch.equal(dense, flex)
    assert dense[0, 0, 0, :12].sum() == 0 and dense[0, 0, 0, 12:16].all()  # anchor 0: no context, own block


def test_loss_weights_and_tau_estimate():
    assert [loss_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0] and 5.0 < loss_gamma(12) < 7.0
    correct = torch.tensor([[[True, True, False], [False, True, True], [True, True, True]]])
    mask = torch.tensor([[[True, True, True], [True, True, True], [True, True, False]]])
    slot_correct, slot_count, accepted, blocks = correctness_stats(correct, mask)
    assert slot_correct.tolist() == [2, 3, 1] and slot_count.tolist() == [3, 3, 2]
    assert accepted.item() == (1 + 2) + (1 + 0) + (1 + 2) and blocks.item() == 3  # an unlabelled slot is a miss
    hidden = torch.randn(1, 3, 3, 8)
    result = block_loss(hidden, lambda h: h @ torch.eye(8), torch.zeros(1, 3, 3, dtype=torch.long), mask, 4.0)
    logp = torch.log_softmax(hidden, -1)[..., 0]  # the weighted mean of -log p(label)
    weights = torch.exp(-torch.arange(3) / 4.0).expand(1, 3, 3)
    torch.testing.assert_close(result.loss, -(logp * weights)[mask].sum() / weights[mask].sum())


def test_mask_token_choice():
    class Tok:
        bos_token_id = eos_token_id = pad_token_id = unk_token_id = None
        chat_template = None
        all_special_tokens = []

        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

        def __len__(self):
            return len(self.vocab)

    smol = Tok({"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<issue_start>": 8, "a": 9})
    assert choose_mask_token(smol, 10) == (8, "<issue_start>")
    assert choose_mask_token(Tok({"a": 0, "<|MASK|>": 5}), 10) == (5, "<|MASK|>")
    assert choose_mask_token(Tok({"a": 0, "b": 1}), 10) == (2, "<|MASK|>")  # a spare embedding row
    assert spread_layer_ids(30, 3) == (1, 14, 27) and spread_layer_ids(2, 2) == (1, 0)
