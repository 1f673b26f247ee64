"""The queued-rounds setting (engine/overlap.py): validated, and auto (on where the device runs ahead
of the host) by default. (Queued rounds in the engine: tests/integration/test_queued_rounds.py.)"""

from __future__ import annotations

import pytest


def test_queue_setting_is_validated():
    from flashtree.config import SchedulerConfig
    from flashtree.errors import ConfigError

    with pytest.raises(ConfigError, match="queue_plain_rounds"):
        SchedulerConfig(queue_plain_rounds="yes")
    assert SchedulerConfig().queue_plain_rounds is None  # auto: where the device runs ahead (CUDA)
