"""Structured output on the tiny pair: constrained speculation is lossless (the same tokens as plain
constrained decoding, greedy and sampled, rows with and without a grammar in one batch), outputs
follow the grammar, draft trees hold only nodes the grammar allows, both grammar backends agree,
and a grammar that does not compile is a clear request error."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest

from flashtree import LLM, SamplingParams
from flashtree.errors import RequestError
from flashtree.structured import StructuredOutput
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401  (one_thread: a fixture)
from tests.support.workload import BLOCK, ENGINE, PROMPTS, VOCAB

HEADS, TAILS = ("hello", "world"), ("tree", "flash", "w1", "w2")
REGEX = f"({'|'.join(HEADS)})({'|'.join(TAILS)}){{2,6}}"  # token strings concatenated (a word-level tokenizer)
STOPS = ("</s>", "<|im_end|>")
METHODS = [dict(spec="dflash"), dict(spec="ddtree", budget=4), dict(spec="ddtree", budget=16)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("structured"), vocab=VOCAB, block_size=BLOCK)


@pytest.fixture(scope="module")
def plain(pair):
    return LLM(str(pair.target), **ENGINE)


def _params(rows: int, temperature: float = 0.0) -> list[SamplingParams]:
    """Every other row constrained by REGEX; the others free (ignore_eos, so they run to max_tokens)."""
    spec = StructuredOutput("regex", REGEX)
    return [SamplingParams(max_tokens=12, temperature=temperature, seed=100 + i,
                           structured=spec if i % 2 == 0 else None, ignore_eos=i % 2 == 1) for i in range(rows)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: "-".join(map(str, m.values())))
def test_constrained_speculation_equals_constrained_plain(pair, plain, method, temperature):
    params = _params(len(PROMPTS), temperature)
    expected = plain.generate(PROMPTS, params)
    llm = LLM(str(pair.target), draft=str(pair.drafter), **method, **ENGINE)
    got = llm.generate(PROMPTS, params)
    for ref, out in zip(expected, got):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
    assert any(n > 1 for out in got[::2] for n in out.acceptance_lengths)  # drafts of grammar rows are accepted
    free = plain.generate(PROMPTS[1::2], params[1::2])  # the free rows, alone, decode as they did beside grammar rows
    assert [o.token_ids for o in free] == [o.token_ids for o in got[1::2]]


def test_outputs_follow_the_grammar(plain):
    tokenizer = plain.tokenizer
    for temperature in (0.0, 1.0):
        for out in plain.generate(PROMPTS, _params(len(PROMPTS), temperature))[::2]:
            pieces = tokenizer.convert_ids_to_tokens(out.token_ids)
            if out.finish_reason == "stop":
                assert pieces[-1] in STOPS
                pieces = pieces[:-1]
                assert re.fullmatch(REGEX, "".join(pieces)), pieces
            else:
                assert re.fullmatch(f"({'|'.join(HEADS)})({'|'.join(TAILS)}){{0,6}}", "".join(pieces)), pieces


@pytest.mark.parametrize("method", [{}] + METHODS, ids=lambda m: "-".join(map(str, m.values())) or "plain")
def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(pair, plain, method):
    """ignore_eos keeps a free request going past its stop tokens, but a grammar ends with one: the request
    finishes there ("stop"), with the same tokens under every method, never with text past the grammar."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, structured=StructuredOutput("regex", REGEX))
    llm = LLM(str(pair.target), draft=str(pair.drafter), **method, **ENGINE) if method else plain
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    for out in outs:
        pieces = plain.tokenizer.convert_ids_to_tokens(out.token_ids)
        assert out.finish_reason == "stop" and pieces[-1] in STOPS, pieces
        assert re.fullmatch(REGEX, "".join(pieces[:-1])), pieces


def _allowed_at(index: int) -> set[str]:
    """What REGEX allows as output token ``index``, token by token (the stop tokens once it may end)."""
    if index == 0:
        return set(HEADS)
    return (set(TAILS) if index <= 6 else set()) | (set(STOPS) if index >= 3 else set())


def test_trees_hold_only_what_the_grammar_allows(pair, tmp_path):
    trace = tmp_path / "trees.jsonl"
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=16, trace_trees=str(trace), **ENGINE)
    params = [SamplingParams(max_tokens=12, structured=StructuredOutput("regex", REGEX))] * len(PROMPTS)
    llm.generate(PROMPTS, params)
    llm.engine.close_traces()
    emitted = defaultdict(int)  # request -> output index of its next round's root
    checked = 0
    for line in map(json.loads, trace.read_text().splitlines()):
        root = emitted[line["request_id"]]
        emitted[line["request_id"]] += len(line["accepted_path"])
        names = llm.tokenizer.convert_ids_to_tokens(line["tokens"])
        depth = [0] * len(names)
        for node in range(1, len(names)):
            parent = line["parents"][node]
            depth[node] = depth[parent] + 1
            assert names[parent] not in STOPS or parent == 0, "a node after a stop token"
            assert names[node] in _allowed_at(root + depth[node]), (names, node)
            checked += 1
    assert checked > 50


def test_a_backend_that_cannot_read_the_tokenizer_says_so(pair):
    """llguidance reads byte-level tokenizers only (the real model's test compares the backends)."""
    llm = LLM(str(pair.target), grammar_backend="llguidance", **ENGINE)
    with pytest.raises(RequestError, match="llguidance grammar backend cannot read this model's tokenizer.*xgrammar"):
        llm.generate([PROMPTS[0]], SamplingParams(structured=StructuredOutput("regex", REGEX)))


@pytest.mark.parametrize("spec, named", [
    (dict(kind="regex", value="(unclosed"), "regex"),
    (dict(kind="grammar", value="root ::= undefined_rule"), "grammar"),
    (dict(kind="json", value="{not json"), "json schema"),
])
def test_a_grammar_that_does_not_compile_is_a_request_error(plain, spec, named):
    with pytest.raises(RequestError, match=named):
        plain.generate([PROMPTS[0]], SamplingParams(structured=StructuredOutput(**spec)))
    assert not plain.engine.has_work  # nothing was queued


def test_choice_gives_one_of_the_choices(plain):
    spec = StructuredOutput("choice", ["hellotree", "worldw1w2"])  # (token strings concatenated)
    for out in plain.generate(PROMPTS[:4], SamplingParams(max_tokens=8, structured=spec)):
        pieces = plain.tokenizer.convert_ids_to_tokens(out.token_ids)
        assert out.finish_reason == "stop" and "".join(pieces[:-1]) in ("hellotree", "worldw1w2")
