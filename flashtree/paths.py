"""Where flashtree keeps files: its cache (converted GGUF models, built CPU kernels) and its shipped assets."""

from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"  # drafters that ship with the package


def cache_root() -> Path:
    """``$FLASHTREE_CACHE``, else ``~/.cache/flashtree``."""
    return Path(os.environ.get("FLASHTREE_CACHE") or Path.home() / ".cache" / "flashtree")
