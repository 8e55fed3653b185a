"""Shared fixtures: a real redis-server per test session on a free port (never fakeredis)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from shared.localredis import LocalRedis

# the Python client SDK is imported as its users import it (`import llm_stream_client`), from
# the tree rather than an install, so the tests always run the SDK of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))


@pytest.fixture(scope="session")
def redis_server():
    server = LocalRedis(appendonly=True).start()
    yield server
    server.stop()


@pytest.fixture
def stream_prefix() -> str:
    """A fresh key prefix per test so tests sharing the session's server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def redis_client(redis_server):
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of a tiny random-weight model (real SmolLM2 tokenizer); set MODEL_PATH to it for workers."""
    from tests.tiny_model import make_tiny_model_dir
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer (SmolLM2's), for engine tests."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tokenizer):
    """An in-memory tiny random Llama (tests.tiny_model.tiny_llama), fresh per module: the engine
    may fuse or quantize a model's layers in place, so modules do not share one."""
    from tests.tiny_model import tiny_llama
    return tiny_llama(tokenizer)


@pytest.fixture(scope="module")
def stack(request, redis_server, tmp_path_factory):
    """The module's gateway+worker stack (tests.stack_fixtures.Stack), as its `STACK` spec says."""
    from tests.stack_fixtures import worker_stack
    spec = request.module.STACK
    model_dir = None if spec.synthetic else request.getfixturevalue("tiny_model_dir")
    with worker_stack(redis_server.url, spec, tmp_path_factory.mktemp(f"{spec.name}-logs"), model_dir) as s:
        yield s


@pytest.fixture
def make_settings(stack):
    """`make_settings(**overrides)`: settings of a gateway on the module's stack."""
    return stack.settings
