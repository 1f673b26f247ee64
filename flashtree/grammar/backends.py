"""Grammar backends: compile a request's :class:`~flashtree.structured.StructuredOutput` for one
tokenizer and follow the output token by token.

Two well-kept engines do the work: xgrammar (the default: about 10 us to fill a token mask for a
JSON schema over SmolLM2's 49,152 tokens on a 2-core EPYC) and llguidance (about 110 us there, no
compile step, Lark grammars). Both fill the same token bitmask, int32 ``[W]`` per row with
``W = ceil(V / 32)``, bit ``t % 32`` of word ``t // 32`` set when token t is allowed.

JSON has a fixed layout, never free whitespace (a small model given free whitespace can emit it
forever): with xgrammar, indented by two spaces, the layout models write JSON in by themselves, so
the drafter predicts it (SmolLM2, DDTree-4 on a 2-core EPYC, benchmarks/json_layout_tau.py: mean
acceptance 2.47 against 1.95 for compact JSON and 2.22 for free whitespace of at most 16); with
llguidance, compact.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from flashtree.config import GRAMMAR_BACKENDS as BACKENDS
from flashtree.errors import ConfigError, RequestError
from flashtree.structured import StructuredOutput


class GrammarMatcher(Protocol):
    """One request's place in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no move) when the grammar forbids it."""

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 ``[rows, W]``, CPU)."""

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may follow."""


JSON_INDENT = 2  # xgrammar's JSON layout (see the module docstring)


def bitmask_words(vocab: int) -> int:
    return (vocab + 31) // 32


class Grammars:
    """Compiles structured-output requests for one tokenizer; one matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int] | set[int],
                 backend: str = "xgrammar"):
        if backend not in BACKENDS:
            raise ConfigError(f"grammar backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer; this model has none")
        self.backend, self.vocab = backend, vocab_size
        self.words = bitmask_words(vocab_size)
        make = _xgrammar_factory if backend == "xgrammar" else _llguidance_factory
        try:
            self._make: Callable[[StructuredOutput], GrammarMatcher] = make(tokenizer, vocab_size,
                                                                            sorted(stop_token_ids))
        except Exception as exc:  # noqa: BLE001 (a tokenizer the backend cannot read: its own error types)
            others = [b for b in BACKENDS if b != backend]
            raise RequestError(f"structured output: the {backend} grammar backend cannot read this model's "
                               f"tokenizer ({_first_line(exc)}); try --grammar-backend {others[0]}") from None

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A matcher at the start of ``spec``'s grammar; a RequestError names what does not compile."""
        try:
            return self._make(spec)
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 (the backends raise their own types: RuntimeError, ValueError...)
            raise RequestError(f"structured output: the {spec.kind} does not compile with {self.backend}: "
                               f"{_first_line(exc)}") from None


class LazyGrammars:
    """:class:`Grammars` made at the first :meth:`matcher` call, by whichever thread asks first (building
    one reads the whole vocabulary; most servers never need it). A construction that fails (no tokenizer,
    one the backend cannot read) raises its RequestError and is tried again at the next call."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int] | set[int],
                 backend: str = "xgrammar"):
        self._arguments = (tokenizer, vocab_size, stop_token_ids, backend)
        self._grammars: Grammars | None = None
        self._made = threading.Lock()

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        with self._made:
            if self._grammars is None:
                self._grammars = Grammars(*self._arguments)
        return self._grammars.matcher(spec)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _choice_rules(choices: tuple[str, ...]) -> str:
    """The alternatives as quoted string literals (EBNF and Lark read JSON's escapes)."""
    return " | ".join(json.dumps(choice) for choice in choices)


# ---------------------------------------------------------------------------- xgrammar
def _xgrammar_factory(tokenizer, vocab_size: int, stop_ids: list[int]) -> Callable[[StructuredOutput], GrammarMatcher]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)  # (it caches compiled grammars itself)

    def compile_spec(spec: StructuredOutput):
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.value, any_whitespace=False, indent=JSON_INDENT)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, indent=JSON_INDENT)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar(f"root ::= {_choice_rules(spec.value)}")
        return compiler.compile_grammar(spec.value)

    return lambda spec: _XGrammarMatcher(xgrammar.GrammarMatcher(compile_spec(spec)))


class _XGrammarMatcher:
    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def rollback(self, count: int) -> None:
        if count:
            self._matcher.rollback(count)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()


# ---------------------------------------------------------------------------- llguidance
def _llguidance_factory(tokenizer, vocab_size: int, stop_ids: list[int]) -> Callable[[StructuredOutput], GrammarMatcher]:
    import llguidance
    import llguidance.hf

    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)  # (its eos: the tokenizer's)
    compact = {"whitespace_flexible": False}

    def grammar_of(spec: StructuredOutput) -> str:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, overrides=compact)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=compact)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(f"start: {_choice_rules(spec.value)}")
        return llguidance.LLMatcher.grammar_from_lark(spec.value)

    def make(spec: StructuredOutput) -> GrammarMatcher:
        matcher = llguidance.LLMatcher(lltokenizer, grammar_of(spec))
        if matcher.is_error():
            raise RequestError(f"structured output: the {spec.kind} does not compile with llguidance: "
                               f"{matcher.get_error()[:300]}")
        return _LLGuidanceMatcher(matcher, frozenset(stop_ids))

    return make


class _LLGuidanceMatcher:
    """llguidance's matcher, with the engine's stop tokens: any of them may end the output where the
    grammar may end (llguidance itself knows one end-of-sequence token, and once the grammar can only
    end it takes no token at all). A stop token is kept here, not in llguidance's matcher."""

    def __init__(self, matcher, stop_ids: frozenset[int]):
        import llguidance.torch

        self._matcher, self._stop_ids = matcher, stop_ids
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._consumed: list[bool] = []  # per accepted token: llguidance's matcher consumed it
        self._terminated = False

    def accept(self, token: int) -> bool:
        if self._terminated:
            return False
        if token in self._stop_ids and (self._matcher.is_stopped() or self._matcher.is_accepting()):
            self._consumed.append(False)
            self._terminated = True
            return True
        # (consume_token of a forbidden token errs the matcher: validate first)
        if self._matcher.is_stopped() or not self._matcher.validate_tokens([token]):
            return False
        if not self._matcher.consume_token(token):
            return False
        self._consumed.append(True)
        return True

    def rollback(self, count: int) -> None:
        if count:
            undone, self._consumed = self._consumed[-count:], self._consumed[:-count]
            consumed = sum(undone)
            if consumed:
                self._matcher.rollback(consumed)
            self._terminated = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_stopped():
            bitmask[row] = 0
        else:
            self._fill(self._matcher, bitmask, row)
        if self._matcher.is_stopped() or self._matcher.is_accepting():
            for token in self._stop_ids:
                bitmask[row, token >> 5] |= _bit(token & 31)

    @property
    def terminated(self) -> bool:
        return self._terminated


def _bit(position: int) -> int:
    """An int32 word's bit ``position`` as a signed value (bit 31 is the sign)."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
