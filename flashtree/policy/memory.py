"""The adaptive policy's memory across processes: what it learned (``learned.py``) kept in a small
JSON file per engine setup, so that a fresh process (each ``flashtree generate``) starts where the
last one of the same setup stopped instead of exploring drafted rounds again.

- Where: ``$FLASHTREE_POLICY_CACHE`` (a directory; ``off`` turns the memory off), else ``policy/``
  under flashtree's cache root (``flashtree.paths.cache_root``: ``$FLASHTREE_CACHE``, else
  ``~/.cache/flashtree``). ``--no-policy-cache`` (``SpeculationConfig.policy_cache``) turns it off.
- Setup (the file's key): everything an option's cost or acceptance depends on: the target's and
  the drafter's files (path, size and modification time of each file), the method and its ladder,
  block size and draft vocabulary, the device (its model name), dtype and CPU threads, the kernel
  settings, tensor parallelism, the policy's knobs and flashtree's version. One file per setup,
  named by the key's hash; the file repeats its key, and a file whose key differs is not used.
- When: read when the policy is made; written when the interpreter exits, from the last policy made
  for the setup in the process (a process killed by a signal writes nothing), atomically (a
  temporary file renamed over the old one; of two processes that end together, the last one's
  state stays).
- A file that cannot be read or parsed, or of another format version, is ignored with a warning
  (and replaced at exit); one older than ``MAX_AGE_S`` is ignored quietly (the code or the machine
  may have changed since, and the policy learns afresh), and deleted when another file is written.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from flashtree.config import EngineConfig
from flashtree.paths import cache_root
from flashtree.policy.adaptive import AdaptivePolicy
from flashtree.policy.learned import Learned
from flashtree.version import __version__

FORMAT_VERSION = 1  # of the file; another version is ignored (and replaced at exit)
MAX_AGE_S = 7 * 24 * 3600.0  # an older file is not used
ENV = "FLASHTREE_POLICY_CACHE"
OFF = ("off", "0", "false", "no")

log = logging.getLogger("flashtree")


def memory_directory() -> Path | None:
    """Where the memory files go, or None when ``$FLASHTREE_POLICY_CACHE`` turns the memory off."""
    given = os.environ.get(ENV)
    if given is not None and given.strip().lower() in OFF:
        return None
    return Path(given) if given else cache_root() / "policy"


def files_identity(name: str | None) -> dict | None:
    """A model or drafter as given, with the size and modification time of its file, or of each
    file of its directory (a hub id or the embedded model's name: the name alone)."""
    if name is None:
        return None
    path = Path(name)
    if path.is_file():
        return {"path": str(path.resolve()), "files": [_stat(path)]}
    if path.is_dir():
        return {"path": str(path.resolve()), "files": [_stat(f) for f in sorted(path.iterdir()) if f.is_file()]}
    return {"name": name}


def _stat(path: Path) -> list:
    info = path.stat()
    return [path.name, info.st_size, info.st_mtime_ns]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_model() or platform.processor() or platform.machine()


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def engine_setup(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> dict:
    """The engine's part of a memory file's key (the policy adds its ladder and knobs)."""
    spec = config.speculation
    return {"flashtree": __version__,
            "target": {**dataclasses.asdict(config.target), "files": files_identity(config.target.model)},
            "drafter": files_identity(spec.draft), "method": spec.method, "block_size": spec.block_size,
            "draft_vocab": spec.draft_vocab, "device": device.type, "device_name": device_name(device),
            "dtype": str(dtype), "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "kernels": dataclasses.asdict(config.kernels),
            "tensor_parallel_size": config.parallel.tensor_parallel_size}


class PolicyMemory:
    """The memory file of one engine setup in ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path, setup: dict):
        self.directory, self.setup = Path(directory), setup

    @classmethod
    def for_engine(cls, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> PolicyMemory | None:
        """The memory of this engine's setup, or None when it is off (or nothing adapts)."""
        spec = config.speculation
        directory = memory_directory()
        if not (spec.policy_cache and spec.adaptive and spec.method != "none") or directory is None:
            return None
        return cls(directory, engine_setup(config, device, dtype))

    def key(self, policy: AdaptivePolicy) -> dict:
        return {**self.setup, "ladder": list(policy.ladder), "policy": dataclasses.asdict(policy.config)}

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        return self.directory / f"{digest}.json"

    def attach(self, policy: AdaptivePolicy) -> None:
        """Start ``policy`` from the memory, if any, and write what it learned when the interpreter exits."""
        key = self.key(policy)
        learned = self.recall(key)
        if learned is not None:
            policy.start_from(learned)
        _AT_EXIT[self.path(key)] = (self, policy)  # (a later engine of the same setup replaces an earlier one)

    def recall(self, key: dict) -> Learned | None:
        """The learned estimates kept for ``key``; None when there are none (or none usable)."""
        path = self.path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as error:
            log.warning("flashtree: the policy memory %s cannot be read (%s); starting afresh", path, error)
            return None
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('version') if isinstance(data, dict) else None!r}, "
                                 f"this flashtree reads {FORMAT_VERSION}")
            if data.get("key") != json.loads(json.dumps(key)):
                return None  # (another setup whose key hashed alike)
            saved_at = data.get("saved_at")
            if not isinstance(saved_at, int | float) or time.time() - saved_at > MAX_AGE_S:
                return None
            return Learned.from_json(data.get("learned"))
        except (ValueError, TypeError) as error:
            log.warning("flashtree: ignoring the policy memory %s: %s", path, error)
            return None

    def save(self, policy: AdaptivePolicy) -> Path:
        """Keep what ``policy`` learned (what happens at exit; a caller may do it sooner)."""
        return self.keep(self.key(policy), policy.learned())

    def keep(self, key: dict, learned: Learned) -> Path:
        """Write ``learned`` for ``key`` (atomically: a temporary file renamed over the old one)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"version": FORMAT_VERSION, "saved_at": time.time(), "key": key,
                           "learned": learned.to_json()}, indent=1)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self._forget_old_files()
        return path

    def _forget_old_files(self) -> None:
        """Delete the directory's memory files (and stray temporaries) last written over ``MAX_AGE_S`` ago."""
        oldest = time.time() - MAX_AGE_S
        for stale in [*self.directory.glob("*.json"), *self.directory.glob("*.tmp")]:
            try:
                if stale.stat().st_mtime < oldest:
                    stale.unlink()
            except OSError:
                pass  # (another process's, gone already)


_AT_EXIT: dict[Path, tuple[PolicyMemory, AdaptivePolicy]] = {}  # memory file -> the policy whose state it gets
# at exit (held strongly: an engine may be gone by then, its small policy is kept)


def _save_at_exit() -> None:
    """At interpreter exit: each attached policy that ran rounds writes its file; a failure to write
    is a warning (the memory only spares exploration)."""
    for memory, policy in _AT_EXIT.values():
        if policy.rounds_chosen:
            try:
                memory.save(policy)
            except OSError as error:
                log.warning("flashtree: the policy memory could not be written to %s: %s", memory.directory, error)


atexit.register(_save_at_exit)
