"""Reading trace files in tests."""

from __future__ import annotations


def by_request_order(lines: list[dict]) -> list[dict]:
    """Trace lines with request ids replaced by the order the requests first appear in (ids count up
    across engines)."""
    order: dict[str, int] = {}
    return [{**line, "request_id": order.setdefault(line["request_id"], len(order))} for line in lines]
