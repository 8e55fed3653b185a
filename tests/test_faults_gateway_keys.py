"""A gateway that is gone leaves no key of its own behind without an expiry (issue 34 item 6:
after dropped sockets, `p:{g:<gw>}:reqs` sets of dead gateways stayed in Redis forever).

Real processes: a worker on the tiny model, two gateways, a real redis-server. Gateway A holds
requests (a live socket's and a dropped socket's, parked as orphans) and is SIGKILLed; once
gateway B has taken over its requests, every `{g:<A>}` key has a TTL. And while a gateway
lives, its `reqs` set carries a TTL its heartbeat refreshes, so even a gateway no survivor
ever takes over leaves nothing for good."""

from __future__ import annotations

import signal

from shared.streams import META_GW, Keys, as_str
from tests.gateway_client import GatewayClient, eventually
from tests.stack_fixtures import metric, scrape, start_gateway
from tests.test_faults_gateway_liveness import AUTH, LONG, gw_env, start_worker_proc


async def keys_of(redis, keys: Keys, gw: str) -> dict[str, int]:
    """Every key of gateway `gw`'s slot, with its TTL (-1: none)."""
    found = {}
    async for key in redis.scan_iter(match=f"{keys.prefix}:{{g:{gw}}}:*"):
        found[as_str(key)] = await redis.ttl(key)
    return found


async def test_a_sigkilled_gateways_keys_all_expire_after_takeover(redis_server, redis_client, stream_prefix,
                                                                    tiny_model_dir, tmp_path):
    keys = Keys(stream_prefix)
    worker = start_worker_proc(redis_server.url, stream_prefix, tiny_model_dir, tmp_path)
    env = gw_env(RESUME_GRACE_S=30)
    gw_a, base_a = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-a", env=env)
    gw_b, base_b = start_gateway(redis_server.url, stream_prefix, tmp_path, name="gw-b", env=env)
    try:
        ws_a = base_a.replace("http", "ws") + "/v1/stream"
        live = await GatewayClient.connect(ws_a, headers=AUTH)
        rid = await live.generate("kept", prompt="A story:", max_tokens=LONG)
        dropped = await GatewayClient.connect(ws_a, headers=AUTH)
        for i in range(2):
            await dropped.generate(f"d{i}", prompt=f"Story {i}:", max_tokens=LONG)
        await dropped.close()                                 # parked as orphans by gw-a itself
        assert (await live.recv("kept", timeout=30))["type"] == "chunk"
        gw = as_str(await redis_client.hget(keys.meta(rid), META_GW))
        reqs = keys.gw_reqs(gw)
        assert await redis_client.scard(reqs) >= 1
        # alive: the set carries a TTL, refreshed by the heartbeat
        assert await eventually(lambda: _ttl_positive(redis_client, reqs), timeout=5)

        gw_a.signal(signal.SIGKILL)
        gw_a.popen.wait(10)

        async def taken_over() -> bool:
            return metric(await scrape(base_b + "/metrics"), "gateway_orphans_taken_over_total") >= 1
        assert await eventually(taken_over, timeout=20)
        assert await redis_client.zscore(keys.gateways, gw) is None

        async def all_expiring() -> bool:
            found = await keys_of(redis_client, keys, gw)
            return all(ttl > 0 for ttl in found.values())
        assert await eventually(all_expiring, timeout=5), await keys_of(redis_client, keys, gw)
        await live.close()
    finally:
        for p in (gw_a, gw_b, worker):
            p.stop()


async def _ttl_positive(redis, key: str) -> bool:
    return await redis.ttl(key) > 0
