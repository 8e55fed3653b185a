"""shared.redis_client against a real redis-server: commands packed by hiredis' C packer are
byte for byte what redis-py's own packer sends, and values round-trip."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from shared.redis_client import HiredisConnection, connect

ARGS = [
    ("SET", "k", "plain"),
    ("SET", "k", "é ünïcode ✓"),
    ("SET", b"k", b"\x00\xff binary \r\n"),
    ("ZADD", "z", 0.1, "a", 1 / 3, "b", 1e20, "c", -5, "d", 2**70, "e"),
    ("XADD", "s", "MAXLEN", "~", 1000, "5-0", "d", memoryview(b"mv"), "e", bytearray(b"ba")),
    ("CLIENT SETNAME", "n"),           # a two-word command name is split like redis-py does
    (b"CONFIG GET", "maxmemory"),
]


@pytest.mark.parametrize("args", ARGS, ids=lambda a: str(a[0]))
def test_hiredis_packing_sends_the_same_bytes_as_redis_py(args):
    python_packed = b"".join(bytes(b) for b in Connection().pack_command(*args))
    assert b"".join(HiredisConnection().pack_command(*args)) == python_packed
    assert (b"".join(HiredisConnection().pack_commands([args, args]))
            == b"".join(bytes(b) for b in Connection().pack_commands([args, args])))


@pytest.mark.parametrize("bad", [None, True, object()])
def test_what_redis_py_refuses_is_refused_with_its_error(bad):
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", bad)
    with pytest.raises(DataError):
        HiredisConnection().pack_command("SET", "k", bad)


async def test_clients_use_it_and_values_round_trip(redis_server, stream_prefix):
    for i, client in enumerate((connect(redis_server.url), connect(redis_server.url, max_connections=4))):
        try:
            assert client.connection_pool.connection_class is HiredisConnection
            key = f"{stream_prefix}:rt{i}"
            await client.set(key, "é\x00✓")
            assert (await client.get(key)).decode() == "é\x00✓"
            async with client.pipeline(transaction=False) as pipe:
                pipe.zadd(key + "z", {"a": 0.1, "b": 2**40})
                pipe.zscore(key + "z", "a")
                pipe.zscore(key + "z", "b")
                assert await pipe.execute() == [2, 0.1, float(2**40)]
        finally:
            await client.aclose()
