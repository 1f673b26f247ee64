"""JSONL shards that grow over many runs: ``part-00000.jsonl.gz``, ``part-00001.jsonl.gz``, ... (gzip, the
default: text answers take about a third of the bytes, so a device call brings back and carries three times as
many) or ``part-00000.jsonl``, ... uncompressed.

Each writer starts a new shard after the highest one present, of either kind (a run never rewrites an earlier
run's shard, so a device call brings back only what it wrote) and starts another once the current one would pass
``max_bytes`` on disk. A flush makes every line written so far readable (gzip: a sync flush, which keeps the
compression window); a line cut off by a killed run, or a gzip stream a killed run left without its end, is
dropped by the reader from the cut on (:func:`flashtree.train.data.iter_jsonl`).
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

SHARD_SUFFIXES = {"gzip": ".jsonl.gz", "none": ".jsonl"}
_SHARD_INDEX = re.compile(r"^part-(\d+)\.jsonl(\.gz)?$")
_GZIP_SLACK = 64  # bytes a gzip shard may still grow by when flushed and closed (block ends and the 8-byte trailer)


def shard_name(index: int, compression: str = "gzip") -> str:
    return f"part-{index:05d}{SHARD_SUFFIXES[compression]}"


class ShardWriter:
    def __init__(self, directory: str | Path, max_bytes: int, compression: str = "gzip"):
        if compression not in SHARD_SUFFIXES:
            raise ValueError(f"shard compression {compression!r}; allowed: {', '.join(SHARD_SUFFIXES)}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.compression = max_bytes, compression
        indices = [int(m.group(1)) for p in self.directory.iterdir() if (m := _SHARD_INDEX.match(p.name))]
        self.next_index = max(indices, default=-1) + 1
        self.file = None  # the shard's file on disk
        self.handle = None  # what lines are written to (the file, or a gzip stream over it)
        self.unflushed = 0  # bytes written since the last flush (a gzip stream may hold them back)
        self.line_bytes = 0  # bytes of lines in the current shard (a shard always takes its first line)
        self.written: list[Path] = []

    def write(self, line: str) -> None:
        data = line.encode("utf-8")
        if self.handle is None or (self.line_bytes and self._size() + len(data) > self.max_bytes):
            self._roll()
        self.handle.write(data)
        self.unflushed += len(data)
        self.line_bytes += len(data)

    def flush(self) -> None:
        if self.handle is not None:
            self.handle.flush()
            if self.handle is not self.file:  # (the gzip stream's output, buffered in the file object)
                self.file.flush()
            self.unflushed = 0

    def _size(self) -> int:
        """The shard's bytes on disk once what was written so far is flushed and the shard closed (at most: the
        gzip stream's pending input may come out a little larger than it went in, stored)."""
        if self.compression == "none":
            return self.file.tell()
        return self.file.tell() + self.unflushed + self.unflushed // 1024 + _GZIP_SLACK

    def _roll(self) -> None:
        self.close()
        path = self.directory / shard_name(self.next_index, self.compression)
        self.next_index += 1
        self.file = path.open("xb")
        self.handle = gzip.GzipFile(fileobj=self.file, mode="wb", mtime=0) if self.compression == "gzip" else self.file
        self.unflushed = self.line_bytes = 0
        self.written.append(path)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.file.close()
            self.handle = self.file = None
