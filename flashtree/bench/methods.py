"""Benchmark methods: ``ar`` (plain decoding), ``dflash`` (chain), ``ddtree`` / ``ddtree:N`` (tree, budget N),
and ``llama.cpp`` (llama.cpp on the same GGUF, ``bench/llamacpp.py``)."""

from __future__ import annotations

import dataclasses

from flashtree.bench.llamacpp import LLAMA_CPP
from flashtree.config import SpeculationConfig
from flashtree.errors import ConfigError

PLAIN = "ar"
METHOD_FORMS = f"ar, dflash, ddtree, ddtree:N (N = node budget), {LLAMA_CPP} (CPU, a GGUF target)"


@dataclasses.dataclass(frozen=True)
class BenchMethod:
    label: str  # as the user wrote it, e.g. "ddtree:64"
    spec_method: str  # SpeculationConfig.method: none | dflash | ddtree; or llama.cpp (no engine)
    budget: int | None = None  # DDTree budget; None = the engine's default

    @property
    def is_plain(self) -> bool:
        return self.spec_method == "none"

    @property
    def is_llamacpp(self) -> bool:
        return self.spec_method == LLAMA_CPP

    def speculation(self, base: SpeculationConfig) -> SpeculationConfig:
        """This method's speculation; ``base`` gives the drafter, its block size and draft vocabulary,
        and whether the policy adapts."""
        if self.is_plain or self.is_llamacpp:
            return SpeculationConfig(adaptive=base.adaptive, policy=base.policy)
        return dataclasses.replace(base, method=self.spec_method, budget=self.budget)


def parse_method(text: str) -> BenchMethod:
    name, _, budget = text.strip().partition(":")
    if name == PLAIN and not budget:
        return BenchMethod(PLAIN, "none")
    if name == "dflash" and not budget:
        return BenchMethod("dflash", "dflash")
    if text.strip() == LLAMA_CPP:
        return BenchMethod(LLAMA_CPP, LLAMA_CPP)
    if name == "ddtree":
        return BenchMethod(text.strip(), "ddtree", _parse_budget(text, budget) if budget else None)
    raise ConfigError(f"--methods: {text!r} is not a method; allowed: {METHOD_FORMS}")


def _parse_budget(text: str, budget: str) -> int:
    try:
        value = int(budget)
    except ValueError:
        value = -1
    if value < 1:
        raise ConfigError(f"--methods: {text!r} needs a positive integer budget after ':', e.g. ddtree:64")
    return value


def parse_methods(text: str) -> list[BenchMethod]:
    """Comma-separated methods; plain decoding always runs first (it is the reference)."""
    methods = [parse_method(part) for part in text.split(",") if part.strip()]
    if not methods:
        raise ConfigError(f"--methods is empty; give a comma-separated list of: {METHOD_FORMS}")
    labels = [m.label for m in methods]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ConfigError(f"--methods lists {', '.join(duplicates)} more than once")
    plain = [m for m in methods if m.is_plain] or [parse_method(PLAIN)]
    return plain + [m for m in methods if not m.is_plain]
