"""Prompt sources for regeneration: whitespace-normalized deduplication, the bench's prompts and
hash band left out, the held-out band, HumanEval-style prompts from Python files; JSONL shards
that grow run after run, and a line cut off by a killed writer."""

import gzip
import json

import pytest

from flashtree.errors import ConfigError
from flashtree.train.data import iter_jsonl, shard_files, split_fraction
from flashtree.train.prompt_sources import (
    collect_prompts,
    documented_functions,
    python_function_prompts,
)
from flashtree.train.shard_writer import ShardWriter


def write_chats(path, chats):
    with path.open("w") as handle:
        for conv_id, text in chats:
            handle.write(json.dumps({"id": conv_id, "messages": [{"role": "user", "content": text},
                                                                 {"role": "assistant", "content": "ok"}]}) + "\n")
    return path


def ids_in_band(lo, hi, count, prefix="c"):
    """``count`` conversation ids whose split key hashes into [lo, hi)."""
    found, i = [], 0
    while len(found) < count:
        if lo <= split_fraction(f"{prefix}{i}") < hi:
            found.append(f"{prefix}{i}")
        i += 1
    return found


def test_dedup_bench_exclusion_and_split_bands(tmp_path):
    train_ids = ids_in_band(10, 100, 6)
    held_id, = ids_in_band(2, 5, 1)
    bench_band_id, = ids_in_band(0, 2, 1)
    chats = write_chats(tmp_path / "chats.jsonl", [
        (train_ids[0], "Hello world, how are you?"),
        (train_ids[1], "Hello   world,\nhow are you?  "),  # the same after whitespace normalization
        (train_ids[2], "hello world, how are you?"),  # another text (case)
        (train_ids[3], "Write a   function\tthat adds two numbers."),  # a bench prompt, spaced differently
        (train_ids[4], "Something new to answer."),
        (held_id, "A held-out question about trees."),
        (bench_band_id, "A chat the bench may send."),
        (train_ids[5], "Something new to answer."),  # exact duplicate
    ])
    prompts, stats = collect_prompts([str(chats)], bench_texts=["Write a function that adds two numbers."],
                                     heldout_percent=3.0, bench_percent=2.0)
    kept = {p.prompt_id: p for p in prompts}
    assert set(kept) == {train_ids[0], train_ids[2], train_ids[4], held_id}
    # the exact duplicate never reaches the count: the chat reader keeps one of equal texts itself
    assert stats.read == 7 and stats.duplicates == 1 and stats.bench == 2 and (stats.train, stats.heldout) == (3, 1)
    assert kept[held_id].split == "heldout" and all(p.split == "train" for i, p in kept.items() if i != held_id)
    assert kept[held_id].record() == {"id": held_id, "split": "heldout", "source": str(chats),
                                      "messages": [{"role": "user", "content": "A held-out question about trees."}]}
    with pytest.raises(ConfigError, match="heldout-percent"):
        collect_prompts([str(chats)], heldout_percent=99.0)
    packed = tmp_path / "chats.jsonl.gz"  # a gzipped file reads the same (smaller to carry)
    packed.write_bytes(gzip.compress(chats.read_bytes()))
    assert [p.prompt_id for p in collect_prompts([str(packed)], heldout_percent=3.0, bench_percent=2.0)[0]] == \
        [p.prompt_id for p in collect_prompts([str(chats)], heldout_percent=3.0, bench_percent=2.0)[0]]


def test_python_function_prompts_show_signature_and_docstring_only(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "mod.py").write_text(
        'import os\n\n'
        'def add(a: int, b: int) -> int:\n    """Return the sum of a and b, both integers, as an integer."""\n'
        '    return a + b\n\n'
        'def _private(x):\n    """A private helper that nobody outside should ever be calling."""\n    return x\n\n'
        'def short(x):\n    """Too short."""\n    return x\n\n'
        'class Box:\n    def area(self, scale=1):\n        """The area of the box, multiplied by the scale factor."""\n'
        '        return self.w * self.h * scale\n')
    (pkg / "tests" / "helpers.py").write_text('def helper():\n    """A test helper function with a long docstring."""\n')
    (pkg / "broken.py").write_text("def (:\n")
    assert [name for name, _ in documented_functions(pkg / "mod.py")] == ["add", "Box.area"]
    prompts = list(python_function_prompts(pkg, "Complete:\n{prompt}END"))
    assert [p.prompt_id for p in prompts] == ["py:mod.py:add", "py:mod.py:Box.area"]
    add, area = (p.messages[0]["content"] for p in prompts)
    assert add == ('Complete:\ndef add(a: int, b: int) -> int:\n'
                   '    """Return the sum of a and b, both integers, as an integer."""\nEND')
    assert area.startswith("Complete:\ndef area(self, scale=1):\n") and "return" not in area


def test_shards_grow_run_after_run_and_a_cut_line_is_dropped(tmp_path):
    for run in range(2):
        writer = ShardWriter(tmp_path, max_bytes=100, compression="none")
        for i in range(5):
            writer.write(json.dumps({"id": f"{run}-{i}", "pad": "x" * 20}) + "\n")
        writer.close()
    shards = sorted(p.name for p in tmp_path.iterdir())
    assert len(shards) >= 4 and all((tmp_path / s).stat().st_size <= 100 for s in shards)
    ids = [r["id"] for s in shards for _, r in iter_jsonl(tmp_path / s)]
    assert ids == [f"{run}-{i}" for run in range(2) for i in range(5)]
    last = tmp_path / shards[-1]
    with last.open("a") as handle:
        handle.write('{"id": "cut", "pa')  # a killed writer
    assert [r["id"] for _, r in iter_jsonl(last)][-1] == "1-4"
    first = tmp_path / shards[0]
    first.write_text('{"id": "bad", "pa\n' + first.read_text())
    with pytest.raises(ConfigError, match="not valid JSON"):
        list(iter_jsonl(first))  # a bad line inside a shard is an error, not a cut


def test_gzip_shards_keep_their_size_and_a_killed_stream_keeps_its_flushed_lines(tmp_path):
    """gzip shards (the default) stay within max_bytes on disk, number on after plain ones, read back every
    line, and a stream a killed writer left without its end gives every line flushed before the kill."""
    (tmp_path / "part-00000.jsonl").write_text(json.dumps({"id": "plain"}) + "\n")
    writer = ShardWriter(tmp_path, max_bytes=600)
    records = [{"id": f"r{i}", "text": f"answer {i}: " + "the same words again " * 8} for i in range(40)]
    for record in records:
        writer.write(json.dumps(record) + "\n")
        writer.flush()
    writer.close()
    shards = shard_files(tmp_path)
    assert shards[0].name == "part-00000.jsonl" and shards[1].name == "part-00001.jsonl.gz"
    assert len(shards) > 2 and all(p.stat().st_size <= 600 for p in shards)
    assert [r["id"] for p in shards for _, r in iter_jsonl(p)] == ["plain"] + [r["id"] for r in records]
    raw = sum(len(json.dumps(r)) + 1 for r in records)
    assert sum(p.stat().st_size for p in shards[1:]) < raw / 2  # repetitive text compresses

    killed = ShardWriter(tmp_path / "killed", max_bytes=10**6)
    for record in records[:5]:
        killed.write(json.dumps(record) + "\n")
        killed.flush()
    killed.write('{"id": "cut", "te')
    killed.handle.flush()  # reaches the disk, but the stream never gets its end (no close)
    path = killed.written[0]
    assert [r["id"] for _, r in iter_jsonl(path)] == [r["id"] for r in records[:5]]
    with pytest.raises(EOFError):
        gzip.decompress(path.read_bytes())  # (the stream has no end marker)
