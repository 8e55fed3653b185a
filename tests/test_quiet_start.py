"""A first start is quiet and true (issue 37 item 5): `scripts/stack.py` — what scripts/serve.sh
runs — on a fresh Redis of its own with the default model (SmolLM2 from its GGUF) and
LOG_FORMAT=json prints no WARNING (no "entries-read counter was wrong" on a group Redis just
created), no progress bar (the GGUF loader's tqdm), only JSON lines from the gateway and the
worker, and a settings line naming the Redis the stack really runs, not the default URL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STACK = ROOT / "scripts" / "stack.py"

pytestmark = pytest.mark.slow      # loads the real SmolLM2


def test_a_fresh_stack_starts_and_stops_without_a_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MODEL_PATH", "TQDM_DISABLE",
                                                            "HF_HUB_DISABLE_PROGRESS_BARS")}
    env.update({"LOG_FORMAT": "json", "STREAM_PREFIX": f"quiet{uuid.uuid4().hex[:6]}", "TORCH_THREADS": "1",
                "PYTHONUNBUFFERED": "1"})
    state_file = tmp_path / "stack.json"
    log = tmp_path / "stack.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(STACK), "--gateways", "1", "--workers", "1", "--gateway-port", "0",
                                 "--worker-metrics-port", "-1", "--run-dir", str(tmp_path / "run"), "--state-file",
                                 str(state_file), "--ready-timeout", "280"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not state_file.exists():      # written once every child is ready
            assert proc.poll() is None, f"stack.py exited during start-up:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready in time:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        state = json.loads(state_file.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    lines = log.read_text(errors="replace").splitlines()
    text = "\n".join(lines)
    assert "worker-0 ready" in text and "stopped cleanly" in text, text[-3000:]
    assert "WARNING" not in text and "Traceback" not in text, text[-4000:]
    assert "it/s]" not in text and "%|" not in text, "a progress bar in the log"
    children = [line.split("| ", 1)[1] for line in lines if line.startswith(("gateway-0 ", "worker-0 "))]
    records = [json.loads(line) for line in children]          # every line a child printed is one object
    assert records and not [r for r in records if r["level"] not in ("INFO", "DEBUG")]
    assert any(r["process"] == "engine" and "model " in r["message"] for r in records)   # the GGUF loaded
    [settings] = [line for line in lines if line.startswith("stack settings: ")]
    redis_url = json.loads(settings.split(": ", 1)[1])["redis_url"]
    assert redis_url == state["redis_url"] != "redis://127.0.0.1:6379/0"
