"""The browser page end to end: headless Chromium -> gateway -> Redis -> a real worker (tiny model)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.settings import GatewaySettings
from shared.localredis import free_port
from tests.stack_fixtures import Proc, gateway_in_process, prefix_with_worker, start_gateway, wait_http_ok

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium not installed (setup.sh --browser)")]


@pytest.fixture(scope="module")
def browser_stack(redis_server, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with prefix_with_worker(redis_server.url, tiny_model_dir, logs, name="w-browser") as prefix:
        yield prefix


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


async def test_page_connects_on_load_and_has_a_favicon(redis_server, browser_stack):
    """A new visitor sees "connected" before sending anything (the page opens its socket on
    load), and nothing the page asks for is missing: /favicon.ico is an icon, not a 404."""
    from playwright.async_api import async_playwright, expect

    settings = GatewaySettings(redis_url=redis_server.url, stream_prefix=browser_stack, heartbeat_s=5, ws_ping_s=5,
                               ping_timeout_s=10)
    async with gateway_in_process(settings) as gw, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            statuses: list[tuple[str, int]] = []
            page.on("response", lambda resp: statuses.append((resp.url, resp.status)))
            await page.goto(gw.base + "/")
            await expect(page.locator("#conn")).to_have_text("connected", timeout=15000)
            await expect(page.locator("#conn")).to_have_class(re.compile(r"\bon\b"))
            assert gw.probe.metric("gateway_active_sockets") == 1
            assert await page.locator(".msg").count() == 0          # nothing sent yet
            status, kind, size = await page.evaluate(
                "fetch('/favicon.ico').then(async r => [r.status, r.headers.get('content-type'), "
                "(await r.arrayBuffer()).byteLength])")
            assert (status, kind) == (200, "image/x-icon") and size > 0
            assert await page.locator('link[rel="icon"]').get_attribute("href") == "/favicon.ico"
            assert not [s for s in statuses if s[1] >= 400], statuses
        finally:
            await browser.close()
    icon = (ROOT / "gateway" / "static" / "favicon.ico").read_bytes()
    assert icon[:4] == b"\x00\x00\x01\x00"          # an ICO header (image type 1)


@contextlib.contextmanager
def two_gateways_behind_nginx(redis_url: str, prefix: str, run_dir: Path):
    """Two gateway processes and nginx (the deploy/nginx config, as scripts/stack.py runs it)."""
    from stack import nginx_binary, nginx_config
    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx not installed (scripts/setup.sh --proxy installs nginx-light)")
    env = {"RESUME_GRACE_S": 10, "HEARTBEAT_S": 5}
    gateways = [start_gateway(redis_url, prefix, run_dir, name=f"gw-{i}", env=env) for i in range(2)]
    port = free_port()
    (run_dir / "nginx-tmp").mkdir(exist_ok=True)
    conf = run_dir / "nginx.conf"
    conf.write_text(nginx_config(run_dir, port, [int(base.rsplit(":", 1)[1]) for _, base in gateways]))
    proxy = Proc(subprocess.Popen([binary, "-e", "stderr", "-p", str(run_dir), "-c", str(conf), "-g", "daemon off;"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True),
                 run_dir / "nginx.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/nginx-health", proxy)
        yield gateways, f"http://127.0.0.1:{port}"
    finally:
        proxy.signal(signal.SIGQUIT)
        proxy.stop()
        for gw, _ in gateways:
            gw.stop()


def active_sockets(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    return float(re.search(r"^gateway_active_sockets (\S+)$", text, re.M).group(1))


async def test_page_answer_survives_its_gateway_being_killed(redis_server, browser_stack, tmp_path):
    """The page streams through nginx; the gateway holding its socket is SIGKILLed mid-answer.
    The JS SDK reconnects (nginx picks the other gateway), resumes from its last seq, and the
    answer on the page is exactly the greedy reference, with no gap and no repeat."""
    from playwright.async_api import async_playwright, expect

    from llm_stream_client import StreamClient

    prompt, max_tokens = "Write a very long story about a lighthouse.", 400
    with two_gateways_behind_nginx(redis_server.url, browser_stack, tmp_path) as (gateways, proxy):
        async with StreamClient(gateways[1][1].replace("http", "ws") + "/v1/stream") as ref:
            reference = await ref.generate(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                           temperature=0).collect()
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page(viewport={"width": 900, "height": 700})
                await page.goto(proxy + "/")
                await page.click("#settings summary")
                await page.fill("#maxtokens", str(max_tokens))
                await page.fill("#temperature", "0")
                await page.fill("#prompt", prompt)
                await page.click("#send")
                await page.wait_for_function("parseInt(document.getElementById('tokens').textContent) >= 20",
                                             timeout=30000)
                holders = [i for i, (_, base) in enumerate(gateways) if active_sockets(base) >= 1]
                assert len(holders) == 1, holders
                victim = gateways[holders[0]][0]
                victim.signal(signal.SIGKILL)
                victim.popen.wait(10)
                seen_at_kill = int(await page.locator("#tokens").inner_text())
                assert seen_at_kill < max_tokens, "the answer ended before the kill; nothing was tested"

                await expect(page.locator("#status")).to_have_text(re.compile(r"^(length|stop)$"), timeout=60000)
                answer = page.locator(".msg.assistant").last.locator("span").first
                assert await answer.text_content() == reference
                assert await page.evaluate("window.llmStream.reconnects") == 1
                await expect(page.locator("#conn")).to_have_text("connected")
                other = gateways[1 - holders[0]][1]
                assert active_sockets(other) >= 1          # the page now lives on the surviving gateway
            finally:
                await browser.close()
