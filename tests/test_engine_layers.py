"""The engine's layering (issue 33): worker/engine imports nothing from the worker above it nor
the Redis codec (it runs in tests, benchmarks and the engine process without them), and only the
KV cache manager (and the memory that owns the pool) touches the `BlockPool`: the scheduler asks
the manager."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "worker" / "engine"


def imported(path: Path) -> set[str]:
    """Modules `path` imports anywhere in it (functions and TYPE_CHECKING blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_engine_imports_nothing_from_the_worker_above_it_nor_the_redis_codec():
    for path in sorted(ENGINE.glob("*.py")):
        names = imported(path)
        upward = {n for n in names if n.startswith("worker.") and not n.startswith("worker.engine")}
        assert not upward, f"{path.name} imports {upward}"
        assert not any(n == "shared.streams" or n.startswith("shared.streams.") for n in names), path.name


def test_only_the_kv_cache_manager_and_the_memory_touch_the_block_pool():
    for path in sorted(ENGINE.glob("*.py")):
        if path.name in ("block_pool.py", "kv_cache.py", "kv_cache_manager.py"):
            continue
        names = imported(path)
        assert "worker.engine.block_pool.BlockPool" not in names, path.name
        text = path.read_text()
        assert ".pool." not in text and "staged_blocks" not in text, path.name
    scheduler = ENGINE / "scheduler.py"
    assert not any(n.startswith("worker.engine.block_pool") for n in imported(scheduler))
