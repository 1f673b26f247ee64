"""JsonLines: the append-only file of JSON lines each engine trace writes to (``--trace-trees``,
``--trace-policy``, ``--trace-steps``). Records are written every ``flush_every`` records (1: at
once) and when the file is closed; a buffered file is also written at interpreter exit, which a
signal may skip (a server closes its traces when it stops)."""

from __future__ import annotations

import atexit
import json
from pathlib import Path


class JsonLines:
    def __init__(self, path: str | Path, flush_every: int = 1):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a", encoding="utf-8")
        self.flush_every = flush_every
        self.pending: list[str] = []
        if flush_every > 1:
            atexit.register(self.flush)

    def write(self, *records: dict) -> None:
        self.pending.extend(json.dumps(record) for record in records)
        if len(self.pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self.pending and not self.file.closed:
            self.file.write("\n".join(self.pending) + "\n")
            self.file.flush()
        self.pending.clear()

    def close(self) -> None:
        self.flush()
        self.file.close()
        if self.flush_every > 1:
            atexit.unregister(self.flush)
