"""Tensor parallelism on the CPU (gloo): a target sharded over 2 and 4 processes gives the
single-process forward (logits within 1e-5 in fp32, captured hidden states, KV reads of earlier
forwards, random weights drawn alike), and an engine with ``tensor_parallel_size=2`` gives the
single-process engine's greedy tokens and acceptance lengths for plain decoding, DFlash and DDTree
(prefix caching and the adaptive policy included), a MoE target too (experts replicated); a worker killed or stopped makes the engine raise
a TensorParallelError within a bounded time, and no call hangs after that."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashtree import LLM, SamplingParams
from flashtree.engine.tp_executor import TensorParallelError
from flashtree.kv.cache import KVCache, KVCacheSpec
from flashtree.models.batch import ForwardBatch, causal_mask
from flashtree.models.build import build_model
from flashtree.models.collectives import Collectives, make_group
from flashtree.models.config import ModelConfig
from flashtree.models.parallel_load import build_shard
from tests.dflash_helpers import one_thread, tiny_pair  # noqa: F401 (a fixture)
from tests.support.workload import BLOCK, ENGINE, PROMPTS, VOCAB, mixed_params

TOLERANCE = 1e-5
CAPTURE = (0, 1)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):  # noqa: F811
    pass


# ---------------------------------------------------------------------------- the sharded forward

def tiny_config(world: int, tied: bool, bias: bool) -> ModelConfig:
    """A 3-layer target whose heads and KV heads divide ``world``, with a vocabulary (33) that does not."""
    return ModelConfig(model_type="qwen2" if bias else "qwen3", vocab_size=33, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4 if world == 4 else 2,
                       head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied,
                       attention_bias=bias, qk_norm=not bias)


def random_checkpoint(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Whole-model weights large enough that the logits are far from flat."""
    model = build_model(config, None, torch.device("cpu"), torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return {name: (1.0 + 0.1 * torch.randn(p.shape, generator=gen)) if name.endswith("norm.weight")
            else 0.2 * torch.randn(p.shape, generator=gen) for name, p in model.named_parameters()}


def two_forwards(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, hidden) of a prefill chunk of 2 rows with a logits index, then of a 4-node tree per row
    (ancestor masks) after it, reading the chunk's K/V."""
    cfg = model.config
    cache = KVCache(KVCacheSpec(cfg.num_hidden_layers, 3, 32, 8, cfg.num_key_value_heads, cfg.head_dim),
                    torch.float32, "cpu")
    counts = torch.tensor([5, 3])
    ids = torch.tensor([[1, 5, 7, 32, 9], [2, 30, 4, 0, 0]])
    chunk = ForwardBatch(ids, torch.arange(5).expand(2, -1), torch.tensor([0, 2]), torch.zeros(2, dtype=torch.long),
                         causal_mask(counts, 5), 5, prefill=True)
    first = model(chunk, cache, logits_index=(counts - 1)[:, None], capture_layers=CAPTURE)
    cache.advance(chunk.slots, counts)
    depths = torch.tensor([0, 1, 1, 2])
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tree = ForwardBatch(torch.tensor([[3, 8, 31, 6], [12, 16, 17, 20]]), counts[:, None] + depths, chunk.slots, counts,
                        ancestors.expand(2, -1, -1), 9)
    second = model(tree, cache, capture_layers=CAPTURE)
    return [(first.logits, first.hidden), (second.logits, second.hidden)]


def _run_rank(rank: int, world: int, port: int, config: ModelConfig, weights, seed: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    collectives = Collectives(make_group(store, rank, world, torch.device("cpu"), 60.0), rank, world)
    model = build_shard(config, weights, torch.device("cpu"), torch.float32, collectives, seed=seed)
    model.use_cpu_kernels(True)
    outputs = two_forwards(model)
    if rank == 0:  # (numpy arrays travel by value: a tensor would travel as a file descriptor that the
        # sending process serves, and this process may exit before the parent has taken it)
        results.put([(logits.numpy().copy(), hidden.numpy().copy()) for logits, hidden in outputs])


def sharded_outputs(config: ModelConfig, weights, world: int, seed: int = 0):
    context = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)  # (a free port)
    port = store.port
    del store
    results = context.Queue()
    ranks = [context.Process(target=_run_rank, args=(r, world, port, config, weights, seed, results))
             for r in range(world)]
    for process in ranks:
        process.start()
    outputs = [(torch.from_numpy(logits), torch.from_numpy(hidden)) for logits, hidden in results.get(timeout=120)]
    for process in ranks:
        process.join(30)
        assert process.exitcode == 0
    return outputs


@pytest.mark.parametrize("world, tied, bias", [(2, True, True), (4, False, False)])
def test_sharded_forward_equals_single_process(world, tied, bias):
    config = tiny_config(world, tied, bias)
    weights = random_checkpoint(config, seed=world)
    whole = build_model(config, weights, torch.device("cpu"), torch.float32)
    whole.use_cpu_kernels(True)
    expected = two_forwards(whole)
    got = sharded_outputs(config, weights, world)
    for (ref_logits, ref_hidden), (logits, hidden) in zip(expected, got):
        assert logits.shape == ref_logits.shape and hidden.shape == ref_hidden.shape
        assert (logits - ref_logits).abs().max() < TOLERANCE
        assert (hidden - ref_hidden).abs().max() < TOLERANCE
        assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    assert ref_logits.std() > 0.1  # (logits far from flat: the comparison means something)


def test_random_weights_shard_the_single_process_draws():
    config = tiny_config(2, tied=False, bias=False)
    whole = build_model(config, None, torch.device("cpu"), torch.float32, seed=5)
    expected = two_forwards(whole)
    got = sharded_outputs(config, None, 2, seed=5)
    for (ref_logits, _), (logits, _) in zip(expected, got):
        assert (logits - ref_logits).abs().max() < 1e-6


# ---------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("tp"), vocab=VOCAB, block_size=BLOCK)


METHODS = {
    "plain": {"spec": "none"},
    "dflash": {"spec": "dflash"},
    "ddtree": {"spec": "ddtree", "budget": 16},
    "ddtree-adaptive-prefix-cache": {"spec": "ddtree", "budget": 8, "adaptive_spec": True, "prefix_caching": True},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_engine_with_two_ranks_equals_one(pair, method):
    settings = {**ENGINE, **METHODS[method]}
    if settings["spec"] != "none":
        settings["draft"] = str(pair.drafter)
    single = LLM(str(pair.target), **settings)
    prompts = PROMPTS + PROMPTS[:3] if settings.get("prefix_caching") else PROMPTS
    params = mixed_params(single, prompts)
    expected = single.generate(prompts, params)
    parallel = LLM(str(pair.target), tensor_parallel_size=2, **settings)
    try:
        assert parallel.engine.model.config.num_key_value_heads == 1  # (rank 0 holds half the KV heads)
        got = parallel.generate(prompts, params)
    finally:
        parallel.engine.executor.close()
    for ref, out in zip(expected, got):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        if not settings.get("adaptive_spec"):  # (the adaptive policy chooses its trees by measured time)
            assert out.acceptance_lengths == ref.acceptance_lengths
    if settings["spec"] == "ddtree" and not settings.get("adaptive_spec"):
        assert max(n for out in got for n in out.acceptance_lengths) >= 2  # trees moved accepted entries


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_lost_worker_raises_a_clear_error(pair, how):
    llm = LLM(str(pair.target), spec="ddtree", draft=str(pair.drafter), tensor_parallel_size=2, worker_timeout_s=2.0,
              **ENGINE)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate(PROMPTS[:2], params)
    worker = llm.engine.executor.workers[0].process
    os.kill(worker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    started = time.perf_counter()
    with pytest.raises(TensorParallelError, match="rank 1" if how == "killed" else "stopped answering"):
        llm.generate(PROMPTS[:2], params)
    assert time.perf_counter() - started < 30
    assert not worker.is_alive()  # (a stopped worker is killed)
    with pytest.raises(TensorParallelError):  # the engine refuses further work at once
        llm.generate(PROMPTS[:1], params)


def test_moe_target_keeps_its_experts_whole_on_every_rank(tmp_path):
    from tests.helpers import tiny_hf_model

    tiny_hf_model("qwen3_moe", vocab_size=40).save_pretrained(tmp_path)
    settings = {"max_context": 64, "max_running": 4}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = LLM(str(tmp_path), **settings).generate(PROMPTS[:3], params)
    parallel = LLM(str(tmp_path), tensor_parallel_size=2, **settings)
    try:
        got = parallel.generate(PROMPTS[:3], params)
    finally:
        parallel.engine.executor.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
