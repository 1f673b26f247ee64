"""JSONL shards that grow over many runs: ``part-00000.jsonl``, ``part-00001.jsonl``, ...

Each writer starts a new shard after the highest one present (a run never rewrites an earlier
run's shard, so a device call brings back only what it wrote) and starts another once the
current one would pass ``max_bytes``. Lines are flushed as they are written; a line cut off by a
killed run is dropped by the reader (:func:`flashtree.train.data.iter_jsonl`).
"""

from __future__ import annotations

import re
from pathlib import Path

SHARD_NAME = "part-{index:05d}.jsonl"
_SHARD_INDEX = re.compile(r"^part-(\d+)\.jsonl$")


class ShardWriter:
    def __init__(self, directory: str | Path, max_bytes: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        indices = [int(m.group(1)) for p in self.directory.iterdir() if (m := _SHARD_INDEX.match(p.name))]
        self.next_index = max(indices, default=-1) + 1
        self.handle = None
        self.size = 0
        self.written: list[Path] = []

    def write(self, line: str) -> None:
        data = line.encode("utf-8")
        if self.handle is None or (self.size and self.size + len(data) > self.max_bytes):
            self._roll()
        self.handle.write(data)
        self.size += len(data)

    def flush(self) -> None:
        if self.handle is not None:
            self.handle.flush()

    def _roll(self) -> None:
        self.close()
        path = self.directory / SHARD_NAME.format(index=self.next_index)
        self.next_index += 1
        self.handle = path.open("xb")
        self.size = 0
        self.written.append(path)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
