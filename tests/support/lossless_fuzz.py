"""Seeded random draws for the lossless fuzz tests (tests/integration/test_lossless_fuzz.py on the CPU,
tests/gpu/test_lossless_fuzz_cuda.py on CUDA): a speculative setup (method, budget, adaptive or fixed, block
size, packed verification, round-size bound, sometimes a drafter that copies the target), the engine settings
both engines share (rows, page size, prefill chunk and step size, prefix caching, a page pool small enough to
make requests wait, queued plain rounds), and a batch of requests (random prompts, about half sharing a
prefix; lengths, stop tokens, penalties, minimum lengths, log-probabilities, structured output, seeded sampling
with top-p / top-k), and the runs they are checked by: all at once, arriving between steps with some aborted,
and all at once on two tensor-parallel ranks."""

from __future__ import annotations

import importlib.util
import random

from flashtree import LLM, SamplingParams
from flashtree.structured import StructuredOutput
from tests.dflash_helpers import use_copying_proposer

VOCAB = 24
MAX_CONTEXT = 96
WORDS_REGEX = "(hello|world)(tree|flash|w1|w2){2,6}"  # words of the tiny tokenizer (dflash_helpers), concatenated


def draw_settings(rng: random.Random, device: str = "cpu", dtype: str = "float32") -> dict:
    """The engine settings both engines share."""
    page_size = rng.choice([1, 4, 5, 16])
    chunk = rng.choice([1, 3, 8, 32])
    settings = dict(device=device, dtype=dtype, max_context=MAX_CONTEXT, page_size=page_size,
                    max_running=rng.choice([1, 2, 3, 8]), prefill_chunk=chunk,
                    max_prefill_tokens=rng.choice([None, chunk, 2 * chunk]),
                    prefix_caching=rng.random() < 0.5, queue_plain_rounds=rng.choice([None, True, False]))
    if rng.random() < 0.3:  # room for about two requests at full context: the others wait for pages
        settings["kv_pages"] = 2 * -(-(MAX_CONTEXT + 64) // page_size) + 1
    return settings


def draw_speculation(rng: random.Random) -> dict:
    """The speculative engine's own settings (``copying_depth``: see :func:`drafted_engine`)."""
    method = rng.choice(["dflash", "ddtree"])
    speculation = dict(spec=method, adaptive_spec=rng.random() < 0.4, block_size=rng.choice([None, None, 2, 4]),
                       packed_verify=rng.choice([None, True, False]), max_round_tokens=rng.choice([None, None, 64]))
    if method == "ddtree":
        speculation["budget"] = rng.choice([1, 2, 3, 5, 8, 16, 40])
    if rng.random() < 0.35:
        speculation["copying_depth"] = rng.choice([2, 5])
    return speculation


XGRAMMAR_INSTALLED = importlib.util.find_spec("xgrammar") is not None


def draw_requests(rng: random.Random, structured: bool = True) -> list[tuple[list[int], SamplingParams]]:
    """2-9 requests: prompts of 1-40 tokens, about half extending a shared prefix, each with a max_tokens limit,
    and now and then a stop token, the tokenizer's own stop tokens, a penalty, a minimum length,
    log-probabilities, a regular expression to follow (with ``structured``) or seeded sampling (temperature,
    top-p, top-k)."""
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 24))]
    requests = []
    for _ in range(rng.randint(2, 9)):
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(0 if rng.random() < 0.5 else 1, 16))]
        prompt = (shared[:rng.randint(1, len(shared))] + tail) if rng.random() < 0.5 else tail or [rng.randrange(VOCAB)]
        stop = (rng.randrange(VOCAB),) if rng.random() < 0.3 else ()
        extras = {}
        if rng.random() < 0.25:  # logits the output changes: the tree's nodes must see their own path's output
            extras = rng.choice([dict(repetition_penalty=1.3), dict(presence_penalty=0.7),
                                 dict(frequency_penalty=0.4, presence_penalty=0.2)])
        max_tokens = rng.randint(1, 40)
        if rng.random() < 0.15:
            extras["min_tokens"] = rng.randint(1, min(8, max_tokens))
        if rng.random() < 0.15:
            extras["logprobs"] = rng.choice([0, 2])  # (rounds with log-probabilities run eagerly)
        if rng.random() < 0.12 and structured:  # structured output: trees hold only what the grammar allows
            extras["structured"] = StructuredOutput("regex", WORDS_REGEX)
        if rng.random() < 0.3:  # sampled: a seed's keyed noise gives every method plain decoding's draws
            extras.update(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(1 << 31),
                          **rng.choice([{}, dict(top_p=0.9), dict(top_k=5), dict(top_p=0.8, top_k=3)]))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.7, stop_token_ids=stop, **extras)
        requests.append((prompt, params))
    return requests


def draw_all(rng: random.Random, device: str, dtype: str, extra: dict | None = None,
             copying: bool = True) -> tuple[dict, dict, list]:
    """(settings, speculation, requests) of one draw; ``extra``: settings added to the drawn ones; ``copying``
    False: never the copying drafter (where it cannot run: under CUDA graphs, in tensor-parallel workers).
    Without xgrammar (the default grammar backend; the GPU machine has none) no request is structured; the
    draws are otherwise the same."""
    settings, speculation = {**draw_settings(rng, device, dtype), **(extra or {})}, draw_speculation(rng)
    if not copying:
        speculation.pop("copying_depth", None)
    structured = "copying_depth" not in speculation and XGRAMMAR_INSTALLED
    return settings, speculation, draw_requests(rng, structured=structured)


def drafted_engine(pair, monkeypatch, speculation: dict, settings: dict) -> LLM:
    """The speculative engine of the draw; with ``copying_depth``, its proposer drafts the target's own greedy
    continuation that deep (a chain for DFlash, the best tree of a near one-hot distribution for DDTree): long
    accepted paths, commits across pages and whole blocks. It drafts no grammar trees (it ignores ``refine``),
    so its draws hold no structured requests. Build the plain engine first (this may patch the proposer of
    every engine built afterwards)."""
    speculation = dict(speculation)
    depth = speculation.pop("copying_depth", None)
    made = use_copying_proposer(monkeypatch, depth, speculation.get("budget")) if depth else None
    llm = LLM(str(pair.target), draft=str(pair.drafter), **speculation, **settings)
    if made:
        made[-1].attach(llm.engine)
    return llm


def outcomes(llm: LLM, requests) -> list[tuple[list[int], str]]:
    outs = llm.generate([prompt for prompt, _ in requests], [params for _, params in requests])
    return [(o.token_ids, o.finish_reason) for o in outs]


def described(settings: dict, speculation: dict, requests, **more) -> dict:
    """The whole draw, for a failing assertion's message."""
    return dict(settings=settings, speculation=speculation, requests=[(p, vars(q)) for p, q in requests], **more)


def check_all_at_once(pair, monkeypatch, seed: int, device: str = "cpu", dtype: str = "float32", **draw) -> None:
    """The draw's requests all at once, twice on one speculative engine (its prefix cache and policy have state
    the second time): plain decoding's tokens and finish reasons with the same settings, both times. ``draw``:
    :func:`draw_all`'s ``extra`` and ``copying``."""
    rng = random.Random(seed)
    settings, speculation, requests = draw_all(rng, device, dtype, **draw)
    plain = outcomes(LLM(str(pair.target), **settings), requests)
    drafted = drafted_engine(pair, monkeypatch, speculation, settings)
    message = described(settings, speculation, requests)
    assert outcomes(drafted, requests) == plain, message
    assert outcomes(drafted, requests) == plain, message


def check_arrivals_and_aborts(pair, monkeypatch, seed: int, device: str = "cpu", dtype: str = "float32",
                              **draw) -> None:
    """The draw's requests arriving between the engine's steps, some aborted while they wait, prefill or decode:
    every other request gets plain decoding's tokens (alone in its own batch), the aborted ones finish "abort".
    ``draw``: :func:`draw_all`'s ``extra`` and ``copying``."""
    rng = random.Random(10_000 + seed)
    settings, speculation, requests = draw_all(rng, device, dtype, **draw)
    plain_llm = LLM(str(pair.target), **settings)
    engine = drafted_engine(pair, monkeypatch, speculation, settings).engine
    pending, live, aborted = list(enumerate(requests)), {}, set()
    while pending or engine.has_work:
        while pending and (rng.random() < 0.4 or not engine.has_work):
            index, (prompt, params) = pending.pop(0)
            live[index] = engine.add_request(prompt, params)
        engine.step()
        running = [index for index, req in live.items() if not req.finished and index not in aborted]
        if running and rng.random() < 0.15:
            index = rng.choice(running)
            engine.abort(live[index].request_id)
            aborted.add(index)
    kept = [index for index in live if index not in aborted]
    plain = outcomes(plain_llm, [requests[index] for index in kept])
    message = described(settings, speculation, requests, aborted=sorted(aborted))
    assert [(live[index].output_ids, live[index].finish_reason) for index in kept] == plain, message
    assert all(live[index].finish_reason == "abort" for index in aborted), message


def check_tensor_parallel(pair, seed: int) -> None:
    """The draw's requests all at once on a speculative engine with two tensor-parallel ranks (gloo on the
    CPU): the single-process plain engine's tokens and finish reasons. No copying drafter (the workers build
    their own proposers)."""
    settings, speculation, requests = draw_all(random.Random(20_000 + seed), "cpu", "float32", copying=False)
    plain = outcomes(LLM(str(pair.target), **settings), requests)
    parallel = LLM(str(pair.target), draft=str(pair.drafter), tensor_parallel_size=2, **speculation, **settings)
    try:
        assert outcomes(parallel, requests) == plain, described(settings, speculation, requests)
    finally:
        parallel.engine.executor.close()
