"""Training a DFlash2 drafter, its pieces: the training forward (convolutions within each block)
equals inference drafting, a new drafter's config is the public format and its additions start as
no-ops (also when it starts from a first-generation drafter, which it then drafts as), and the loss is the block loss on the unary scores plus the selector's cross-entropy over
its candidates after the true previous token. Training runs: tests/integration/test_train_dflash2.py."""

import pytest
import torch

from flashtree.errors import ConfigError
from flashtree.models.build import build_model
from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.models.dflash2_config import parse_dflash2_config
from flashtree.models.dflash_config import is_dflash2
from flashtree.models.drafters import load_drafter
from flashtree.models.loader import load_checkpoint
from flashtree.train import checkpoint
from flashtree.train.anchors import build_blocks
from flashtree.train.config import TrainConfig
from flashtree.train.dflash2_loss import dflash2_block_loss
from flashtree.train.forward import training_hidden
from flashtree.train.new_drafter import (
    MaskToken,
    dflash2_from_dflash,
    drafter_config_dict,
    trainable_drafter,
)
from flashtree.train.setup import drafter_source
from flashtree.train.target_features import TargetFeatures
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401 (a fixture)
from tests.support.dflash2_checkpoints import tiny_dflash2_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_dflash2_pair(tmp_path_factory.mktemp("pair"), vocab=32, target_layers=3, block_size=4,
                             drafter_layers=2, input_embedding_scale=1.5)


@pytest.fixture(scope="module")
def loaded(pair):
    ckpt = load_checkpoint(str(pair.target))
    target = build_model(ckpt.config, ckpt.weights, torch.device("cpu"), torch.float32)
    return target, ckpt.tokenizer, load_drafter(str(pair.drafter), target, ckpt.tokenizer)


def blocks_of(drafter, ids: torch.Tensor, anchors: torch.Tensor):
    return build_blocks(ids, torch.ones_like(ids, dtype=torch.bool), anchors, torch.ones_like(anchors).bool(),
                        drafter.config.block_size, drafter.config.mask_token_id)


def test_training_forward_equals_inference_drafting(loaded):
    target, _, drafter = loaded
    assert isinstance(drafter, DFlash2Drafter)
    cfg = drafter.config
    ids = torch.randint(0, 30, (1, 24), generator=torch.Generator().manual_seed(0))  # [1, N]
    features = TargetFeatures(target, cfg.target_layer_ids)(ids, torch.tensor([24]))  # [1, N, C]
    anchors = torch.tensor([[0, 5, 11, 12, 23]])  # every block in one pass; neighbours 11, 12 overlap
    drafter.setup_rope(64)
    hidden = training_hidden(drafter, features, blocks_of(drafter, ids, anchors))  # [1, A, b-1, H]
    cache = drafter.new_cache(1, 64, 16)
    slot = torch.tensor([0])
    for a, start in enumerate(anchors[0].tolist()):
        cache.free(slot)
        drafter.observe(cache, slot, features[:, :max(start, 1)], torch.tensor([start]), torch.tensor([0]))
        x = drafter.block_hidden(cache, slot, ids[:, start], torch.tensor([start]), kv_len=start + cfg.block_size)
        torch.testing.assert_close(hidden[0, a], drafter.norm(x)[0, 1:], rtol=1e-5, atol=1e-5)


def test_new_drafter_config_and_start(loaded):
    target, tokenizer, _ = loaded
    raw = drafter_config_dict(target.config, layers=2, block_size=4, mask=MaskToken(31, "<|MASK|>"), arch="dflash2")
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["is_causal"] is False and "block_size" not in raw
    draft = raw["dflash_config"]
    assert draft["block_size"] == 4 and draft["conv_kernel_size"] == 2 and draft["selector_rank"] == 256
    assert draft["conv_group_size"] == 16 and draft["selector_top_k"] == 16  # hidden 32, vocabulary 32
    config = parse_dflash2_config(raw, "new/config.json", target.config, tokenizer)
    assert config.output_multiplier == 1.0 and config.final_logit_softcapping is None
    drafter = trainable_drafter(raw, target, tokenizer, torch.device("cpu"))
    assert isinstance(drafter, DFlash2Drafter) and drafter.training
    assert all(p.requires_grad for p in drafter.parameters())
    # the additions start as no-ops: convolutions pass through, the selector adds nothing
    x = torch.randn(3, 4, 32)
    conv = drafter.layers[1].mlp_conv
    assert torch.equal(conv.around(lambda u: 2 * u, x), 2 * x)
    logits = torch.randn(5, 32)
    unary, candidates = drafter.unary(logits)
    gates = drafter.candidate_selector.hidden_projection(torch.randn(5, 32))
    scores = drafter.candidate_selector.edge_scores(torch.arange(5), gates, candidates, unary)
    assert torch.equal(scores, unary) and drafter.candidate_selector.successor_codebook.std() > 0.1
    first = drafter_config_dict(target.config, layers=2, block_size=4, mask=MaskToken(31, "<|MASK|>"))
    assert first["architectures"] == ["DFlashDraftModel"] and type(
        trainable_drafter(first, target, tokenizer, torch.device("cpu"))).__name__ == "DFlashDrafter"


def test_loss_is_block_plus_selector_cross_entropy(loaded):
    _, _, drafter = loaded
    cfg = drafter.config
    ids = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(1))
    blocks = blocks_of(drafter, ids, torch.tensor([[0, 4, 7], [2, 3, 10]]))  # slots past the end unlabelled
    hidden = torch.randn(2, 3, 3, 32, generator=torch.Generator().manual_seed(2))
    gamma, weight = 4.0, 0.5
    codebook = drafter.candidate_selector.predecessor_codebook
    codebook.requires_grad_(True)
    try:
        result = dflash2_block_loss(drafter, hidden, blocks, gamma, weight)
        (grad,) = torch.autograd.grad(result.loss, [codebook], retain_graph=True)
    finally:
        codebook.requires_grad_(False)
    assert grad.abs().sum() > 0  # the selector's loss reaches its codebooks

    # the same, slot by slot
    head, selector = drafter.target.head, drafter.candidate_selector
    block_terms, selector_terms, correct = [], [], torch.zeros_like(blocks.label_mask)
    for b, a, s in blocks.label_mask.nonzero().tolist():
        w = torch.exp(torch.tensor(-s / gamma))
        label = int(blocks.labels[b, a, s])
        z = head(hidden[b, a, s][None])[0].float()  # [V]
        u = cfg.final_logit_softcapping * torch.tanh(z * cfg.output_multiplier / cfg.final_logit_softcapping)
        block_terms.append((w, -u.log_softmax(-1)[label]))
        candidates = z.argsort(descending=True)[:cfg.selector_top_k]
        previous = int(blocks.block_ids[b, a, 0]) if s == 0 else int(blocks.labels[b, a, s - 1])
        gate = selector.hidden_projection(hidden[b, a, s])
        with torch.no_grad():
            scores = torch.stack([u[c] + (selector.predecessor_codebook[previous] * gate
                                          * selector.successor_codebook[c]).sum() for c in candidates.tolist()])
        if label in candidates.tolist():
            place = candidates.tolist().index(label)
            selector_terms.append((w, -scores.log_softmax(-1)[place]))
            correct[b, a, s] = int(scores.argmax()) == place
    assert selector_terms and len(selector_terms) < len(block_terms)  # some labels are no candidate

    def mean(terms):
        return sum(w * t for w, t in terms) / sum(w for w, _ in terms)

    torch.testing.assert_close(result.loss, mean(block_terms) + weight * mean(selector_terms), rtol=1e-5, atol=1e-5)
    assert torch.equal(result.slot_correct, correct.flatten(0, 1).float().sum(0))
    assert torch.equal(result.slot_count, blocks.label_mask.flatten(0, 1).float().sum(0))


def draft_logits_of(drafter, target, ids: torch.Tensor, start: int) -> torch.Tensor:
    """The drafter's logits ``[1, b-1, V]`` for the block after ``ids[:, :start]``."""
    features = TargetFeatures(target, drafter.config.target_layer_ids)(ids, torch.tensor([ids.shape[1]]))
    drafter.setup_rope(64)
    cache, slot = drafter.new_cache(1, 64, 16), torch.tensor([0])
    drafter.observe(cache, slot, features[:, :start], torch.tensor([start]), torch.tensor([0]))
    with torch.no_grad():
        return drafter.draft_logits(cache, slot, ids[:, start], torch.tensor([start]),
                                    kv_len=start + drafter.config.block_size)


def test_dflash2_started_from_a_first_generation_drafter_drafts_as_it(tmp_path):
    pair = tiny_pair(tmp_path, vocab=48, block_size=5, drafter_layers=2)
    ckpt = load_checkpoint(str(pair.target))
    target = build_model(ckpt.config, ckpt.weights, torch.device("cpu"), torch.float32)
    first = load_drafter(str(pair.drafter), target, ckpt.tokenizer)
    raw, weights = checkpoint.read_drafter(pair.drafter)
    upgraded_raw, upgraded = dflash2_from_dflash(raw, weights, target, ckpt.tokenizer)
    assert is_dflash2(upgraded_raw) and upgraded_raw["dflash_config"]["block_size"] == 5
    assert upgraded_raw["dflash_config"]["target_layer_ids"] == raw["dflash_config"]["target_layer_ids"]
    second = trainable_drafter(upgraded_raw, target, ckpt.tokenizer, torch.device("cpu"), upgraded).eval()
    assert isinstance(second, DFlash2Drafter)
    own = dict(second.named_parameters())
    assert all(torch.equal(own[name], tensor.float()) for name, tensor in weights.items())
    ids = torch.randint(0, 48, (1, 20), generator=torch.Generator().manual_seed(1))
    z = draft_logits_of(first, target, ids, 13)[0]  # [b-1, V] the first generation's logits
    scores = draft_logits_of(second, target, ids, 13)[0]  # [b-1, V] the selector's, -inf off its candidates
    k = upgraded_raw["dflash_config"]["selector_top_k"]
    candidates = z.topk(k, dim=-1).indices  # [b-1, k]
    assert torch.equal(scores.isfinite(), torch.zeros_like(z, dtype=torch.bool).scatter_(-1, candidates, True))
    torch.testing.assert_close(scores.gather(-1, candidates), z.gather(-1, candidates), rtol=1e-5, atol=1e-5)
    assert torch.equal(scores.argmax(-1), z.argmax(-1))  # the chain it proposes
    # through the trainer's setup: --init of a first-generation drafter with --arch dflash2
    raw_setup, weights_setup, state = drafter_source(TrainConfig(init=str(pair.drafter), arch="dflash2"), target,
                                                     ckpt.tokenizer)
    assert is_dflash2(raw_setup) and state is None and set(weights_setup) == set(upgraded)
    kept, _, _ = drafter_source(TrainConfig(init=str(pair.drafter)), target, ckpt.tokenizer)
    assert not is_dflash2(kept)


def test_selector_rank_sets_a_new_or_upgraded_selectors_codebooks(tmp_path, pair, loaded):
    target, tokenizer, _ = loaded
    raw, _, _ = drafter_source(TrainConfig(arch="dflash2", selector_rank=8, layers=2, block_size=4), target, tokenizer)
    drafter = trainable_drafter(raw, target, tokenizer, torch.device("cpu"))
    assert raw["dflash_config"]["selector_rank"] == 8
    assert drafter.candidate_selector.predecessor_codebook.shape == (32, 8)  # [vocabulary, rank]
    first = tiny_pair(tmp_path, vocab=48, block_size=5, drafter_layers=2)
    first_ckpt = load_checkpoint(str(first.target))
    first_target = build_model(first_ckpt.config, first_ckpt.weights, torch.device("cpu"), torch.float32)
    upgraded, weights, _ = drafter_source(TrainConfig(init=str(first.drafter), arch="dflash2", selector_rank=12),
                                          first_target, first_ckpt.tokenizer)
    assert upgraded["dflash_config"]["selector_rank"] == 12
    assert weights["candidate_selector.successor_codebook"].shape == (48, 12)
    # a DFlash2 checkpoint keeps its own rank: another one is refused, naming both
    with pytest.raises(ConfigError, match="--selector-rank 4: .* selector_rank 8"):
        drafter_source(TrainConfig(init=str(pair.drafter), arch="dflash2", selector_rank=4), target, tokenizer)
    with pytest.raises(ConfigError, match="--selector-rank"):
        TrainConfig(selector_rank=8)  # a first-generation drafter has no selector
