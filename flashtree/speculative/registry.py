"""The decoding-method registry: ``--spec none|dflash|ddtree`` -> the engine's proposer."""

from __future__ import annotations

from pathlib import Path

from flashtree.config import EngineConfig
from flashtree.errors import ConfigError
from flashtree.kernels.cpu import fused as cpu_fused
from flashtree.models.dflash2 import DFlash2Drafter, refuse_draft_vocab
from flashtree.models.drafters import load_drafter
from flashtree.models.transformer import CausalLM
from flashtree.speculative.ddtree import DDTreeProposer, default_budget
from flashtree.speculative.dflash import DFlashProposer
from flashtree.speculative.draft_vocab import default_size, load_draft_vocab, vocab_head
from flashtree.speculative.drafter import DrafterRunner
from flashtree.speculative.plain import PlainProposer
from flashtree.speculative.proposer import Proposer


def make_proposer(config: EngineConfig, target: CausalLM, tokenizer) -> Proposer:
    method = config.speculation.method
    if method == "none":
        return PlainProposer()
    if method in ("dflash", "ddtree"):
        return make_drafter_proposer(config, target, tokenizer)
    raise ConfigError(f"--spec {method!r} is not a decoding method; allowed: none, dflash, ddtree")


def make_drafter_proposer(config: EngineConfig, target: CausalLM, tokenizer) -> Proposer:
    """The proposer for ``--spec dflash|ddtree`` with the drafter ``config.speculation.draft``."""
    spec, kernels = config.speculation, config.kernels
    drafter = load_drafter(spec.draft, target, tokenizer, block_size_override=spec.block_size,
                           random_weights=config.target.random_weights, seed=config.target.seed + 1)
    drafter.use_fused_kernels(kernels.gpu_kernels, kernels.cpu_kernels, attention=kernels.triton_attention)
    if drafter.kernels is cpu_fused and kernels.quant_kernels:
        drafter.quantize_blocks()  # CPU: Q8_0 copies for block passes
    runner = DrafterRunner(drafter, config.scheduler.max_running + 1,  # + the pad slot
                           config.cache.max_context, config.scheduler.prefill_chunk)
    drafter_dir = Path(drafter.config.source).parent  # (load_drafter resolved it: its config.json)
    if isinstance(drafter, DFlash2Drafter):
        refuse_draft_vocab(spec.draft_vocab)
        vocab_size = None  # the whole vocabulary
    else:
        vocab_size = default_size(spec.draft_vocab, target.lm_head.weight.device, drafter_dir)
    if vocab_size is not None:
        token_ids = load_draft_vocab(drafter_dir, vocab_size, target.config.vocab_size, at_most=spec.draft_vocab is None)
        runner.restrict_vocab(vocab_head(target.lm_head.weight, target.lm_head_quant, token_ids), token_ids)
    if spec.method == "dflash":
        return DFlashProposer(runner)
    budget = default_budget(target.lm_head.weight.device) if spec.budget is None else spec.budget
    return DDTreeProposer(runner, budget, tree_kernel=kernels.gpu_kernels and kernels.triton_tree)
