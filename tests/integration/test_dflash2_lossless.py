"""DFlash2 drafters through the engine: ``LLM(target, spec=dflash|ddtree, draft=<DFlash2 dir>)``
gives plain decoding's tokens at batch 1 and 3 (greedy, rows of different lengths and stop
conditions), with the C++ kernels and Q8_0 drafter blocks (the CPU default) and with torch ops;
the chain is the selector's walk; seeded sampling equals plain; a copying tree is still lossless
when the selector's candidates exclude the target's token."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from flashtree.models.dflash2 import DFlash2Drafter
from flashtree.speculative.ddtree import DDTreeProposer
from flashtree.speculative.dflash import DFlashProposer
from tests.dflash_helpers import one_thread  # noqa: F401 (a fixture)
from tests.support.dflash2_checkpoints import tiny_dflash2_pair
from tests.support.workload import BLOCK, ENGINE, PROMPTS, VOCAB, mixed_params

KERNELS = {"cpu": {}, "torch": {"cpu_kernels": False}}
BUDGETS = [1, 4, 16, 64]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one CPU thread


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_dflash2_pair(tmp_path_factory.mktemp("dflash2"), vocab=VOCAB, block_size=BLOCK, drafter_layers=2)


@pytest.fixture(scope="module")
def engines(pair):
    """(method, budget, kernels) -> LLM, built on first use."""
    made: dict[tuple, LLM] = {}

    def get(method: str, budget: int | None = None, kernels: str = "cpu") -> LLM:
        key = (method, budget, kernels)
        if key not in made:
            spec = {} if method == "none" else {"spec": method, "draft": str(pair.drafter)}
            made[key] = LLM(str(pair.target), budget=budget, **spec, **ENGINE, **KERNELS[kernels])
        return made[key]

    return get


def prompts_of(rows: int) -> list[list[int]]:
    return PROMPTS[:rows] if rows > 1 else PROMPTS[4:5]


@pytest.mark.parametrize("kernels", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 3])
def test_chain_equals_plain(engines, rows, kernels):
    plain, chain = engines("none"), engines("dflash", kernels=kernels)
    proposer = chain.engine.proposer
    assert isinstance(proposer, DFlashProposer) and isinstance(proposer.runner.drafter, DFlash2Drafter)
    assert proposer.max_nodes == BLOCK - 1
    params = mixed_params(plain, prompts_of(rows))
    expected = plain.generate(prompts_of(rows), params)
    got = chain.generate(prompts_of(rows), params)
    for ref, out in zip(expected, got):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        assert sum(out.acceptance_lengths) >= len(out.token_ids) - 1  # every token after the first came from a round


@pytest.mark.parametrize("kernels", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("budget", BUDGETS)
def test_tree_equals_plain(engines, rows, budget, kernels):
    plain, tree = engines("none"), engines("ddtree", budget, kernels)
    assert isinstance(tree.engine.proposer, DDTreeProposer) and tree.engine.proposer.max_nodes == budget
    params = mixed_params(plain, prompts_of(rows))
    expected = plain.generate(prompts_of(rows), params)
    got = tree.generate(prompts_of(rows), params)
    for ref, out in zip(expected, got):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        assert all(size <= budget for size in out.tree_sizes)


def test_seeded_sampling_equals_plain(engines):
    plain, chain, tree = engines("none"), engines("dflash"), engines("ddtree", 16)
    params = [SamplingParams(max_tokens=10, temperature=t, top_k=k, seed=s, ignore_eos=True)
              for s, (t, k) in enumerate([(1.0, 0), (0.7, 4), (1.3, 0)] * 3)]
    many = [PROMPTS[i % 3] for i in range(len(params))]
    expected = [o.token_ids for o in plain.generate(many, params)]
    assert [o.token_ids for o in chain.generate(many, params)] == expected
    assert [o.token_ids for o in tree.generate(many, params)] == expected


def test_acceptance_grows_with_the_budget(engines):
    """Bigger trees over the selector's candidates accept more (the drafter's proposals reach the
    verification), and a 64-node tree accepts several tokens in some rounds."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    means = {}
    for budget in (1, 64):
        lengths = [n for o in engines("ddtree", budget).generate(PROMPTS, params) for n in o.acceptance_lengths]
        means[budget] = sum(lengths) / len(lengths)
        if budget == 64:
            assert max(lengths) >= 3
    assert means[64] > means[1] + 0.1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16)])
def test_structured_output_equals_plain(engines, method, budget, temperature):
    """Grammar rows rebuild their trees from the selector's candidates (DrafterRunner.candidates:
    k finite log-probabilities per slot, the rest -inf); tokens equal constrained plain decoding."""
    from flashtree.structured import StructuredOutput

    regex = "(hello|world)(tree|flash|w1|w2){2,6}"  # token strings concatenated (a word-level tokenizer)
    params = [SamplingParams(max_tokens=12, temperature=temperature, seed=100 + i, ignore_eos=i % 2 == 1,
                             structured=StructuredOutput("regex", regex) if i % 2 == 0 else None) for i in range(4)]
    expected = engines("none").generate(PROMPTS[:4], params)
    got = engines(method, budget).generate(PROMPTS[:4], params)
    for ref, out in zip(expected, got):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
