"""Default decoding method: DDTree with the shipped drafter for the embedded default model."""

from __future__ import annotations

from pathlib import Path

from flashtree.paths import ASSETS

SMOLLM2_DRAFTER = ASSETS / "smollm2-dflash"


def shipped_drafter(model: str) -> Path | None:
    """The drafter that ships in the package for ``model``, if any."""
    if model == "smollm2" and (SMOLLM2_DRAFTER / "config.json").is_file():
        return SMOLLM2_DRAFTER
    return None


def default_spec(model: str, spec: str | None, draft: str | None) -> tuple[str, str | None]:
    """(method, drafter) from what the user passed: a drafter implies ddtree; no flags on the
    embedded default mean ddtree with the shipped drafter when one is installed."""
    if draft is None and spec in (None, "dflash", "ddtree"):
        shipped = shipped_drafter(model)
        draft = str(shipped) if shipped else None
    if spec is None:
        spec = "ddtree" if draft else "none"
    return spec, draft
