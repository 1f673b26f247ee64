"""``--data-parallel-size 2``: two engine replicas behind one real uvicorn server, the official
``openai`` client, tiny random models on the CPU.

- Every request (8 at once, plain and DDTree) gets exactly the single engine's greedy text, and both
  replicas served some (the per-replica metrics say how many each routed and generated).
- Multi-turn conversations, interleaved with other requests, each stay on the replica that took
  their first turn (affinity), whose prefix cache then serves their earlier turns' pages.
- Replicas that are tensor-parallel themselves (2 x 2 ranks) serve, and a worker of replica 1 that
  dies makes every replica answer 503 naming it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal

import httpx
import openai
import pytest

from flashtree import LLM, SamplingParams
from tests.support.server import (
    ServerThread,
    metric_value,
    save_tiny_chat_model,
    server_config,
)

ENGINE = {"max_running": 4, "max_context": 192, "prefill_chunk": 8, "page_size": 4, "prefix_caching": True}
PROMPTS = [[5, 6, 7], list(range(3, 20)), [9, 10], [4, 4, 8, 8, 2, 2], list(range(40, 20, -1)), [11, 3, 30],
           [6, 7, 8, 9, 10, 11, 12, 13, 14], [23, 50, 23, 50, 5]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.dflash_helpers import tiny_pair

    return tiny_pair(tmp_path_factory.mktemp("dp"), vocab=64, block_size=4)


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def completion_text(server: ServerThread, prompt_ids: list[int]) -> str:
    return client(server).completions.create(model="tiny", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text


@pytest.mark.parametrize("method", ["none", "ddtree"])
def test_two_replicas_give_the_single_engine_tokens(pair, method):
    spec = {"spec": method} if method == "none" else {"spec": "ddtree", "draft": str(pair.drafter), "budget": 8}
    expected = LLM(str(pair.target), device="cpu", adaptive_spec=False, **spec, **ENGINE).generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    config = server_config(pair.target, method=method, draft=spec.get("draft"), budget=spec.get("budget"),
                           adaptive_spec=False, **ENGINE)
    config = dataclasses.replace(config, data_parallel_size=2)
    with ServerThread(config) as server, concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda ids: completion_text(server, ids), PROMPTS))
        metrics = httpx.get(f"{server.url}/metrics").text
    assert texts == [out.text for out in expected]
    assert all(out.token_ids and len(set(out.token_ids)) > 1 for out in expected)  # (texts that say something)
    for replica in ("0", "1"):
        routed = sum(metric_value(metrics, "flashtree_replica_routed_requests_total", f'reason="{why}",replica="{replica}"')
                     for why in ("affinity", "least_loaded"))
        assert routed >= 1
        assert metric_value(metrics, "flashtree_replica_generation_tokens_total", f'replica="{replica}"') >= MAX_TOKENS
    assert metric_value(metrics, "flashtree_generation_tokens_total") == len(PROMPTS) * MAX_TOKENS


def test_a_conversation_stays_on_one_replica(tmp_path, monkeypatch):
    config = server_config(save_tiny_chat_model(tmp_path / "target"), **ENGINE)
    config = dataclasses.replace(config, data_parallel_size=2)
    with ServerThread(config) as server:
        replicas = server.app.state.flashtree.engine
        routes = []
        real_route = replicas.router.route

        def recorded_route(prompt_ids, loads):
            route = real_route(prompt_ids, loads)
            routes.append((list(prompt_ids), route))
            return route

        monkeypatch.setattr(replicas.router, "route", recorded_route)
        conversations = {name: [{"role": "user", "content": f"hello {name} , how is the {animal} ?"}]
                         for name, animal in (("one", "cat"), ("two", "dog"))}
        where: dict[str, list[int]] = {name: [] for name in conversations}
        for turn in range(3):
            for name, messages in conversations.items():
                answer = client(server).chat.completions.create(
                    model="tiny", messages=messages, max_tokens=6, temperature=0,
                    extra_body={"ignore_eos": True}).choices[0].message.content
                where[name].append(routes[-1][1].replica)
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": f"and the {['sea', 'sky', 'sun'][turn]} ?"}]
            completion_text(server, [7 + turn, 8, 9])  # another request moves the least-loaded choice (ties: fewer routed)
        metrics = httpx.get(f"{server.url}/metrics").text
    for name, replicas_of_turns in where.items():
        assert len(set(replicas_of_turns)) == 1, (name, replicas_of_turns)
    later_turns = [route for prompt, route in routes if len(prompt) > 20]
    first_turn_blocks = len(routes[0][0]) // ENGINE["page_size"]
    assert len(later_turns) == 4 and all(r.reason == "affinity" and r.matched_blocks >= first_turn_blocks
                                         for r in later_turns)
    assert where["one"][0] != where["two"][0]  # (the first turns went to different replicas: the test means something)
    for name in where:
        hits = metric_value(metrics, "flashtree_replica_prefix_cache_hit_tokens", f'replica="{where[name][0]}"')
        assert hits >= 2 * 4 * ENGINE["page_size"]  # its later turns reused the earlier turns' pages


def test_tensor_parallel_replicas_serve_and_a_lost_worker_stops_them_all(tmp_path):
    target = save_tiny_chat_model(tmp_path / "target")
    causes: list[str] = []
    config = server_config(target, tensor_parallel_size=2, worker_timeout_s=60.0, **ENGINE)
    config = dataclasses.replace(config, data_parallel_size=2)
    expected = LLM(str(target), device="cpu", **ENGINE).generate(PROMPTS[:4], SamplingParams(max_tokens=MAX_TOKENS,
                                                                                             ignore_eos=True))
    with ServerThread(config, on_fatal=causes.append) as server, concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda ids: completion_text(server, ids), PROMPTS[:4])) == [o.text for o in expected]
        replicas = server.app.state.flashtree.engine.replicas
        os.kill(replicas[1].engine.executor.workers[0].process.pid, signal.SIGKILL)
        health = httpx.get(f"{server.url}/health", timeout=5)
        for _ in range(100):
            if health.status_code == 503:
                break
            health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and "replica 1" in health.text and "rank 1" in health.text
        with pytest.raises(openai.APIStatusError) as caught:
            completion_text(server, PROMPTS[0])
        assert caught.value.status_code == 503 and "replica 1" in str(caught.value)
        assert all(replica.fatal_error is not None for replica in replicas)
        assert len(causes) == 1 and "replica 1: tensor-parallel worker rank 1" in causes[0]
