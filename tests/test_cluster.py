"""Gateway + worker on a real 3-node Redis Cluster (issue 9 item 6): stream, cancel and resume.

The fixture starts three `redis-server --cluster-enabled yes` on free ports and joins them with
`redis-cli --cluster create`; both processes get `REDIS_URL=redis+cluster://...` and so use
redis-py's cluster client. Every multi-key command, MULTI and script must stay in one slot (a
cross-slot one fails with CROSSSLOT), so this runs the whole data path for real.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from shared.localredis import LocalRedisCluster
from shared.redis_client import connect
from shared.streams import Keys
from tests.gateway_client import GatewayClient
from tests.stack_fixtures import start_gateway, start_worker
from tests.worker_redis import history

pytestmark = pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli (redis-tools) not installed")

PREFIX = "cl"
GW_ENV = {"RESUME_GRACE_S": 10, "FLUSH_INTERVAL_MS": 30, "HEARTBEAT_S": 0, "PER_KEY_RATE_PER_MIN": 100000}


@pytest.fixture(scope="module")
def cluster():
    c = LocalRedisCluster(3).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def cluster_stack(cluster, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("cluster-logs")
    worker = start_worker(cluster.url, PREFIX, tiny_model_dir, logs, name="cw", env={"MAX_BATCH": 16})
    gws = [start_gateway(cluster.url, PREFIX, logs, name=f"cgw{i}", env=GW_ENV) for i in range(2)]
    yield [base.replace("http", "ws") + "/v1/stream" for _, base in gws]
    for proc, _ in gws:
        proc.stop()
    worker.stop()


async def cluster_history(cluster, rid: str) -> list[dict]:
    client = connect(cluster.url)
    try:
        return await history(client, Keys(PREFIX), rid)
    finally:
        await client.aclose()


async def test_stream_cancel_and_resume_through_a_redis_cluster(cluster, cluster_stack):
    url_a, url_b = cluster_stack
    a = await GatewayClient.connect(url_a)
    # stream: several requests, so their keys land in different slots and nodes
    rids = {f"s{i}": await a.generate(f"s{i}", max_tokens=24, prompt=f"Story {i}:") for i in range(6)}
    for cid, rid in rids.items():
        chunks, done = await a.until_done(cid, timeout=60)
        assert done["type"] == "done" and done["finish_reason"] in ("length", "stop"), done
        events = await cluster_history(cluster, rid)
        assert "".join(ch["text"] for ch in chunks) == "".join(e["text"] for e in events if e["k"] == "tok")
        assert done["seq"] == sum(e["n"] for e in events if e["k"] == "tok") == chunks[-1]["seq"]

    # cancel
    rid = await a.generate("c1", max_tokens=1500)
    assert (await a.recv("c1", timeout=30))["type"] == "chunk"
    await a.send(type="cancel", id="c1")
    _, done = await a.until_done("c1", timeout=30)
    assert done["finish_reason"] == "cancelled", done
    assert (await cluster_history(cluster, rid))[-1]["finish_reason"] == "cancelled"

    # resume on the other gateway after an abrupt drop
    rid = await a.generate("r1", max_tokens=300)
    seen = [await a.recv("r1", timeout=30) for _ in range(3)]
    assert all(m["type"] == "chunk" for m in seen), seen
    a.ws.transport.abort()
    b = await GatewayClient.connect(url_b)
    await b.send(type="resume", id="r1", last_seq=seen[-1]["seq"], request_id=rid)
    assert (await b.recv("r1", timeout=30))["type"] == "accepted"
    rest, done = await b.until_done("r1", timeout=60)
    assert done["type"] == "done" and done["finish_reason"] in ("length", "stop"), done
    events = await cluster_history(cluster, rid)
    assert "".join(ch["text"] for ch in seen + rest) == "".join(e["text"] for e in events if e["k"] == "tok")
    assert rest[0]["seq"] - rest[0]["tokens"] == seen[-1]["seq"]
    await b.close()

    # the data really is spread over the cluster's nodes
    sizes = []
    for node in cluster.nodes:
        c = connect(node.url)
        sizes.append(await c.dbsize())
        await c.aclose()
    assert sum(1 for n in sizes if n > 0) >= 2, sizes
    await asyncio.sleep(0)
