"""Every test under tests/integration is ``slow``: it runs engines (tiny random models or the real
SmolLM2), the HTTP server, the command line, training or the benchmark. ``pytest -m "not slow"``
is the fast tier (tests/unit; tests/gpu skip without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.slow)
