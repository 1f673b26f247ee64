"""Structured output: grammar matchers per request (``backends.py``) and draft trees that only hold
what the grammar allows, with the masks the target is verified under (``tree.py``)."""

from flashtree.grammar.backends import BACKENDS, GrammarMatcher, Grammars
from flashtree.grammar.tree import GrammarTree, allowed_tokens, grammar_tree

__all__ = ["BACKENDS", "GrammarMatcher", "GrammarTree", "Grammars", "allowed_tokens", "grammar_tree"]
