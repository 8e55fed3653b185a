"""The request stream's consumer group: creating it, trimming what it finished, and keeping its
counters true across Redis restarts and failovers.

Why its own module: the group is the one piece of Redis state every worker and every gateway's
admission reads, and Redis itself can leave it wrong. Redis 7.0 propagates each XREADGROUP to
the AOF and to replicas as `XCLAIM ... LASTID` without the group's entries-read counter, so a
Redis that reloads its AOF (or a replica promoted by Sentinel or a managed service) comes back
with entries-read at its value of the last AOF rewrite (or unknown), and the group's `lag`
then counts every entry added since as still queued. Gateways do not trust `lag` alone
(shared.backlog), and workers put the counter right whenever they see a new Redis server
(`resync_entries_read`), so operators reading `XINFO GROUPS` see the truth again too.
"""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from shared.backlog import stream_id
from shared.streams import CONSUMER_GROUP, Keys, as_str

log = logging.getLogger("worker.consumer_group")

# KEYS: requests. ARGV: group. Counts the entries after the group's last-delivered id and sets
# entries-read to entries-added minus that count, in one atomic step (a SETID racing a worker's
# XREADGROUP could move last-delivered back and deliver entries twice; inside the script it
# sets last-delivered to the value it already has). The count is O(undelivered entries), run
# only when a worker sees a new Redis or the counter is visibly off, never per request.
# Returns false (no stream or group), or {changed 0/1, entries_read, undelivered, lag_was_wrong 0/1}
# (the group's `lag`, what gateways and operators read, was nil or not the undelivered count; a new
# group has no counter but a true lag).
RESYNC_ENTRIES_READ = """
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return false end
local group
for _, fields in ipairs(groups) do
  local g = {}
  for i = 1, #fields, 2 do g[fields[i]] = fields[i + 1] end
  if g['name'] == ARGV[1] then group = g end
end
if not group then return false end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local stream = {}
for i = 1, #info, 2 do stream[info[i]] = info[i + 1] end
local last = group['last-delivered-id']
local undelivered = #redis.call('XRANGE', KEYS[1], '(' .. last, '+')
local read = stream['entries-added'] - undelivered
local lag_wrong = (group['lag'] ~= undelivered) and 1 or 0
if group['entries-read'] == read then return {0, read, undelivered, lag_wrong} end
redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], last, 'ENTRIESREAD', read)
return {1, read, undelivered, lag_wrong}
"""


async def ensure_group(redis, keys: Keys) -> None:
    """Create the group (and the stream) unless it exists."""
    try:
        await redis.xgroup_create(keys.requests, CONSUMER_GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def resync_entries_read(redis, keys: Keys) -> bool:
    """Set the group's entries-read from what the stream really holds after the group's
    last-delivered id, so `lag` is the number of undelivered entries again. Returns whether the
    counter was wrong, i.e. the group's `lag` (what gateways and operators read) was not the
    number of undelivered entries, or unknown. A counter that is merely absent while `lag` is
    true is a new group (Redis creates one without a counter): it is set quietly, so a fresh
    start does not warn of a failover that never happened."""
    result = await redis.eval(RESYNC_ENTRIES_READ, 1, keys.requests, CONSUMER_GROUP)
    if not result:
        return False
    changed, entries_read, undelivered, lag_wrong = (int(x) for x in result)
    wrong = bool(changed and lag_wrong)
    if wrong:
        log.warning("the request group's entries-read counter was wrong (a Redis restart or failover): set it "
                    "to %d, so its lag reads the %d undelivered entries", entries_read, undelivered)
    elif changed:
        log.debug("the request group had no entries-read counter (a new group), its lag was true: set it to %d",
                  entries_read)
    return wrong


async def counters_look_wrong(redis, keys: Keys) -> bool:
    """A cheap check (O(1)) for a counter that is visibly off: entries-read unknown while
    entries wait, or `lag` above the entries the stream holds that are not pending. (`lag` nil
    with entries-read known means a deleted entry lies ahead, which Redis resolves by itself
    once the group reads past it; a re-sync cannot help there.)"""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xinfo_groups(keys.requests)
        pipe.xinfo_stream(keys.requests)
        groups, stream = await pipe.execute()
    group = next((g for g in groups if as_str(g.get("name")) == CONSUMER_GROUP), None)
    if group is None:
        return False
    if group.get("entries-read") is None:
        return stream_id(group.get("last-delivered-id") or "0-0") < stream_id(stream.get("last-generated-id") or "0-0")
    lag, pending, length = group.get("lag"), int(group.get("pending") or 0), int(stream.get("length") or 0)
    return lag is not None and int(lag) > max(0, length - pending)


async def trim_finished(redis, keys: Keys, *, approximate: bool = True) -> str | None:
    """XTRIM MINID below everything still pending or not yet delivered: only entries whose
    request finished (acked) are removed. The gateway's MAXLEN is only the hard cap.
    Returns the MINID used (None when the group does not exist)."""
    groups = await redis.xinfo_groups(keys.requests)
    group = next((g for g in groups if as_str(g.get("name")) == CONSUMER_GROUP), None)
    if group is None:
        return None
    summary = await redis.xpending(keys.requests, CONSUMER_GROUP)
    if summary and summary.get("pending"):
        minid = as_str(summary["min"])
    else:
        ms, _, seq = as_str(group.get("last-delivered-id", "0-0")).partition("-")
        minid = f"{ms}-{int(seq or 0) + 1}"
    await redis.xtrim(keys.requests, minid=minid, approximate=approximate)
    return minid
