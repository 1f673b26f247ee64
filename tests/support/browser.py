"""Driving the playground (GET /) in Debian's chromium with Playwright, for the browser tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# (as root in a closed network: no sandbox, no background connections)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


class PlaygroundAnswer(NamedTuple):
    text: str
    rounds: list[int]  # the round chips: tokens per round
    tree_nodes: int  # nodes of the last draft tree drawn (the root included)
    page_errors: list[str]


def chat_in_playground(url: str, prompt: str, screenshot: Path, model: str) -> PlaygroundAnswer:
    """Open the playground, send ``prompt``, wait for the whole answer; skips without a browser."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(f"{url}/")
            page.wait_for_function(f"document.getElementById('model').textContent === {model!r}")
            page.fill("#prompt", prompt)
            page.click("#send")
            page.wait_for_selector(".turn.assistant[data-done='true']", timeout=120_000)
            answer = PlaygroundAnswer(page.inner_text(".turn.assistant .text"),
                                      [int(c) for c in page.locator(".rounds span").all_inner_texts()],
                                      page.locator(".tree svg rect").count(), errors)
            page.screenshot(path=str(screenshot), full_page=True)
            return answer
        finally:
            browser.close()
