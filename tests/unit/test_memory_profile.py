"""The activation reserve's profile run (engine/memory_profile.py) on a CPU: it runs the engine's widest
rounds and prefill step on pad rows of a provisional cache, and leaves the engine's tokens as they were."""

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.engine.memory_profile import ActivationReserve
from flashtree.engine.runner import ModelRunner
from flashtree.errors import ConfigError
from flashtree.sampling import MAX_LOGPROBS


def test_profile_runs_the_widest_work_and_leaves_the_tokens_alone(tmp_path, monkeypatch):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=32, block_size=6)
    prompts = [list(range(2, 20)), [5, 6, 7], list(range(3, 30))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", max_running=3, max_context=128, prefill_chunk=16,
                  max_prefill_tokens=40)
    plain = [o.token_ids for o in LLM(str(pair.target), **common).generate(prompts, params)]
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, adaptive_spec=False, **common)
    keys, peaks = [], []
    run_on_pad_rows = ModelRunner.run_on_pad_rows
    monkeypatch.setattr(ModelRunner, "run_on_pad_rows", lambda self, key: keys.append(key) or run_on_pad_rows(self, key))

    def counting_peak(device, run):
        run()
        peaks.append(len(peaks) + 1)
        return 100 * peaks[-1]

    reserve = llm.engine.measure_activation_reserve(counting_peak)
    llm.engine.proposer.attach_pages(llm.engine.pages)  # (the profile left it on its provisional pages)
    # no graphs on a CPU: three widest rounds (greedy, sampled with top-p, with log-probabilities), each twice in a
    # row (one peak each), then the prefill
    assert [(width, shape.nodes, shape.any_sampled, shape.logprobs) for width, shape in keys] == [
        (3, 8, False, None), (3, 8, False, None), (3, 8, True, None), (3, 8, True, None),
        (3, 8, True, MAX_LOGPROBS), (3, 8, True, MAX_LOGPROBS)]
    assert reserve == ActivationReserve(graphed_round=0, widest_round=300, prefill=400) and reserve.bytes == 400
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain


def test_the_profile_captures_every_graph_start_up_captures_in_its_order(tmp_path, monkeypatch):
    """With graphs (a pass-through cache on the CPU), the profile captures the keys start-up captures, in its
    order, and reserves what dropping them gives back: the graphs' pool as start-up's captures leave it, what
    captures of different shapes lose to fragmentation included."""
    import flashtree.engine.engine as engine_module
    from tests.dflash_helpers import PassThroughGraphs, tiny_pair

    pair = tiny_pair(tmp_path, vocab=32, block_size=6)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, adaptive_spec=False, device="cpu",
              dtype="float32", max_running=3, max_context=128)
    captured = []
    init, capture = ModelRunner.__init__, ModelRunner.capture_graphs

    def with_graphs(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.graphs = PassThroughGraphs()

    monkeypatch.setattr(ModelRunner, "__init__", with_graphs)
    monkeypatch.setattr(ModelRunner, "capture_graphs", lambda self, keys: captured.append(list(keys)) or capture(self, keys))
    monkeypatch.setattr(engine_module, "held_bytes", lambda device, make: make() and (7, 3))
    reserve = llm.engine.measure_activation_reserve(lambda device, run: (run(), 100)[1])
    engine = llm.engine
    engine.proposer.attach_pages(engine.pages)
    engine.runner.graphs = PassThroughGraphs()
    start_up = engine.runner.graph_keys(engine.policy.ladder, 3, engine.config.kernels.cuda_graph_max_tokens,
                                        engine.config.scheduler.max_round_tokens)
    assert len(start_up) > 3 and captured == [start_up]  # every round and catch-up graph, widest first
    assert reserve == ActivationReserve(graphed_round=7, widest_round=100, prefill=100, graph_memory=3)


def test_reserve_adds_the_graphs_to_the_larger_eager_peak():
    assert ActivationReserve(graphed_round=5, widest_round=7, prefill=3).bytes == 12
    assert ActivationReserve(graphed_round=0, widest_round=2, prefill=9).bytes == 9
    assert ActivationReserve(graphed_round=5, widest_round=7, prefill=3, graph_memory=4).bytes == 16


def test_the_widest_round_is_the_widest_the_policy_may_choose():
    """The reserve measures what a policy can run: a fixed count at every row, the adaptive policy's options only
    where their bucket's round stays within max_round_tokens."""
    from flashtree.config import PolicyConfig
    from flashtree.policy import AdaptivePolicy, FixedNodes, node_ladder

    capped = AdaptivePolicy(node_ladder(64, chain=False), PolicyConfig(max_round_tokens=4096))
    assert capped.widest_round(256) == (256, 8)  # 2,304 tokens; 64 nodes fit 32 rows (2,080), 16 fit 128 (2,176)
    assert capped.widest_round(20) == (20, 64)  # bucket 32 x 65 tokens fits
    chain = AdaptivePolicy(node_ladder(15, chain=True), PolicyConfig(max_round_tokens=4096))
    assert chain.widest_round(512) == (256, 15)  # 4,096 tokens against 512 plain rows
    assert AdaptivePolicy(node_ladder(64, chain=False), PolicyConfig()).widest_round(256) == (256, 64)  # no cap
    assert FixedNodes(16).widest_round(100) == (100, 16)


def test_widest_work_that_does_not_fit_is_a_clear_config_error(tmp_path):
    from tests.dflash_helpers import tiny_pair

    pair = tiny_pair(tmp_path, vocab=32, block_size=6)
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), budget=8, adaptive_spec=False, device="cpu",
              dtype="float32", max_running=3, max_context=128)

    def out_of_memory(device, run):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(ConfigError, match=r"a round of 3 rows x 9 tokens .* lower --max-running, --budget"):
        llm.engine.measure_activation_reserve(out_of_memory)
