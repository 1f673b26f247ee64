"""The decoding-method registry: ``--spec none|dflash|ddtree`` -> a proposer for the engine."""

from __future__ import annotations

from flashtree.config import EngineConfig
from flashtree.errors import ConfigError
from flashtree.speculative.proposer import PlainProposer, Proposer


def make_proposer(config: EngineConfig, target, tokenizer) -> Proposer:
    method = config.spec.method
    if method == "none":
        return PlainProposer()
    if method in ("dflash", "ddtree"):
        from flashtree.speculative.drafter import make_dflash_proposer

        return make_dflash_proposer(config, target, tokenizer)
    raise ConfigError(f"--spec {method!r} is not a decoding method; allowed: none, dflash, ddtree")
