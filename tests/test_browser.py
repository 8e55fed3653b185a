"""The browser page end to end: headless Chromium -> gateway -> Redis -> a real worker (tiny model)."""

from __future__ import annotations

import os
import re
import uuid

import pytest

from gateway.settings import GatewaySettings
from tests.stack_fixtures import gateway_in_process, start_worker

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium not installed (setup.sh --browser)")]


@pytest.fixture(scope="module")
def browser_stack(redis_server, tiny_model_dir, tmp_path_factory):
    prefix = f"br{uuid.uuid4().hex[:8]}"
    proc = start_worker(redis_server.url, prefix, tiny_model_dir, tmp_path_factory.mktemp("logs"), name="w-browser")
    yield prefix
    proc.stop()


async def test_chat_page_streams_shows_ttft_and_stop_cancels(redis_server, browser_stack, tmp_path):
    from playwright.async_api import async_playwright, expect

    settings = GatewaySettings(redis_url=redis_server.url, stream_prefix=browser_stack, heartbeat_s=5, ws_ping_s=5,
                               ping_timeout_s=10, resume_grace_s=0)
    async with gateway_in_process(settings) as gw, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 900, "height": 700})
            await page.goto(gw.base + "/")
            await page.click("#settings summary")
            await page.fill("#maxtokens", "2000")
            await page.fill("#prompt", "Write a very long story about a lighthouse.")
            await page.click("#send")

            await expect(page.locator("#ttft")).to_have_text(re.compile(r"^\d+ ms$"), timeout=20000)
            assistant = page.locator(".msg.assistant").last
            await expect(assistant).not_to_have_text("", timeout=10000)
            await expect(page.locator("#conn")).to_have_text("connected")
            await expect(page.locator("#stop")).to_be_enabled()
            streamed = await page.locator("#tokens").inner_text()
            await page.screenshot(path=str(tmp_path / "streaming.png"))

            await page.click("#stop")
            await expect(page.locator("#status")).to_have_text("cancelled", timeout=10000)
            await expect(assistant.locator(".meta")).to_have_text("cancelled")
            await expect(page.locator("#send")).to_be_enabled()
            tokens = int(await page.locator("#tokens").inner_text())
            assert 0 < tokens < 2000 and tokens >= int(streamed)
            await page.screenshot(path=str(tmp_path / "cancelled.png"))
            if os.environ.get("BROWSER_SCREENSHOT_DIR"):
                await page.screenshot(path=os.path.join(os.environ["BROWSER_SCREENSHOT_DIR"], "chat.png"))
        finally:
            await browser.close()
