"""The output writer's Lua: the fenced history append, alone or with the live copies and the ack.

Two scripts share one `append` (per request: the epoch fence, the idempotent XADDs, TTLs, the
owner's release at the final):
* `HISTORY_APPEND`: history only. Where Redis enforces slots (a cluster), a script's keys must
  share one, so each call carries one request ({r:rid}) and the live copies (slot {g:gw}) and
  the ack ({q}) follow in round trips of their own.
* `HISTORY_AND_LIVE`: a single Redis (no slots enforced). One call writes its requests'
  history, then, in the same script, each gateway's inbox entry with exactly the events the
  history confirmed (attach markers first), releases the concurrency lease and acks every
  request whose final it confirmed. A flush is then ONE round trip instead of two (three with a
  final): the worker→gateway hop loses a Redis round trip and a worker wake-up per flush, and
  the payloads cross the wire once, not twice. Atomic, so "live never runs ahead of history",
  "a fenced writer never reaches an inbox" and "an ack never precedes its final" hold as before.

Both answer one reply per request, in order: how many of its events were added, or a string
that refuses it (FENCED, CONFLICT, or Redis's own error, e.g. OOM); one request's refusal
never stops the others.
"""

from __future__ import annotations

from typing import Callable

from shared.config import Settings
from shared.streams import CONSUMER_GROUP, INBOX_MAXLEN, Keys

# KEYS: out1, meta1, out2, meta2, ... ARGV: maxlen, ttl_s, worker_id, then per request from `a`:
# epoch, final(0/1), set_ttl(0/1), n, id1, payload1, ... id_n, payload_n.
_APPEND = """
local maxlen, ttl, worker = ARGV[1], ARGV[2], ARGV[3]
local function append(out, meta, a)
  local epoch = redis.pcall('HGET', meta, 'epoch')
  if type(epoch) == 'table' and epoch.err then return epoch.err end
  if epoch ~= ARGV[a] then return 'FENCED meta.epoch is not ' .. ARGV[a] end
  local final, set_ttl, n = ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local added = 0
  for i = a + 4, a + 2 + 2 * n, 2 do
    local r = redis.pcall('XADD', out, 'MAXLEN', '~', maxlen, ARGV[i], 'd', ARGV[i + 1])
    if type(r) == 'table' and r.err then
      if not string.find(r.err, 'equal or smaller', 1, true) then return r.err end
      local there = redis.pcall('XRANGE', out, ARGV[i], ARGV[i])
      if there.err or #there == 0 or there[1][2][2] ~= ARGV[i + 1] then
        return 'CONFLICT another event is at or above ' .. ARGV[i]
      end
    else
      added = added + 1
    end
  end
  if set_ttl == '1' or final == '1' then
    redis.pcall('EXPIRE', out, ttl)
    redis.pcall('EXPIRE', meta, ttl)
  end
  if final == '1' and redis.pcall('HGET', meta, 'owner') == worker then
    redis.pcall('HDEL', meta, 'owner', 'lease')
  end
  return added
end
"""

HISTORY_APPEND = _APPEND + """
local replies, a = {}, 4
for k = 1, #KEYS, 2 do
  replies[#replies + 1] = append(KEYS[k], KEYS[k + 1], a)
  a = a + 4 + 2 * tonumber(ARGV[a + 3])
end
return replies
"""

# KEYS: out1, meta1, ... outR, metaR, inbox1 .. inboxG, requests, conc1 .. concC.
# ARGV: maxlen, ttl_s, worker_id, R, G, inbox_maxlen, group, inbox_ttl_s, then per gateway:
# expire(0/1), h, h head payloads (live copies an earlier round trip could not deliver), then per
# request: gw (1..G, 0: none), marker ('' or an attach marker), ack ('' or its request entry
# id), conc (1..C, 0: none), rid, then append's fields. Returns {replies, inbox errors}.
HISTORY_AND_LIVE = _APPEND + """
local R, G = tonumber(ARGV[4]), tonumber(ARGV[5])
local inbox_maxlen, group, inbox_ttl = ARGV[6], ARGV[7], ARGV[8]
local requests = KEYS[2 * R + G + 1]
local lists, expire, a = {}, {}, 9
for g = 1, G do
  local list, h = {}, tonumber(ARGV[a + 1])
  expire[g] = ARGV[a]
  for i = 1, h do list[i] = ARGV[a + 1 + i] end
  lists[g], a = list, a + 2 + h
end
local replies = {}
for k = 1, R do
  local gw, marker, ack, conc, rid = tonumber(ARGV[a]), ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3]), ARGV[a + 4]
  local n = tonumber(ARGV[a + 8])
  local r = append(KEYS[2 * k - 1], KEYS[2 * k], a + 5)
  replies[k] = r
  local ok = type(r) == 'number'
  if gw > 0 and (ok or string.sub(r, 1, 6) ~= 'FENCED') then
    local list = lists[gw]
    if marker ~= '' then list[#list + 1] = marker end
    if ok then
      for i = a + 10, a + 8 + 2 * n, 2 do list[#list + 1] = ARGV[i] end
    end
  end
  if ok and conc > 0 then redis.pcall('ZREM', KEYS[2 * R + G + 1 + conc], rid) end
  if ok and ack ~= '' then redis.pcall('XACK', requests, group, ack) end
  a = a + 9 + 2 * n
end
local errors = {}
for g = 1, G do
  local list = lists[g]
  local n = #list
  if n > 0 then
    local head
    if n < 16 then head = string.char(144 + n)
    elseif n < 65536 then head = string.char(220, math.floor(n / 256), n % 256)
    else head = string.char(221, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                            math.floor(n / 256) % 256, n % 256) end
    local r = redis.pcall('XADD', KEYS[2 * R + g], 'MAXLEN', '~', inbox_maxlen, '*', 'd', head .. table.concat(list))
    if type(r) == 'table' and r.err then errors[#errors + 1] = r.err end
    if expire[g] == '1' then redis.pcall('EXPIRE', KEYS[2 * R + g], inbox_ttl) end
  end
end
return {replies, errors}
"""


def history_call(keys: Keys, s: Settings, worker_id: str, call: list) -> tuple[list, list]:
    """HISTORY_APPEND's keys and arguments for the (request, frozen events) pairs of one call."""
    names: list = []
    args: list = [s.output_maxlen, s.output_ttl_s, worker_id]
    for st, frozen in call:
        names += (keys.out(st.rid), keys.meta(st.rid))
        args += (st.epoch, int(frozen[-1].final), int(not st.ttl_set), len(frozen))
        for f in frozen:
            args += (f.entry_id, f.payload)
    return names, args


def fused_call(keys: Keys, s: Settings, worker_id: str, call: list, markers: dict[str, bytes],
               backlog: dict[str, list[bytes]], refresh: Callable[[str], bool]) -> tuple[list, list]:
    """HISTORY_AND_LIVE's keys and arguments for one call: its requests (a marker's request may
    have no events), their gateways' inboxes (`backlog`: live copies to put first; `refresh(gw)`:
    renew that inbox's TTL now) and the leases of the finals. A final is acked here unless it
    is dead-lettered (its XADD goes with its ack, in the writer's MULTI)."""
    gws = {gw: i for i, gw in enumerate(backlog, 1)}
    concs: dict[str, int] = {}
    names: list = []
    per_request: list = []
    for st, frozen in call:
        final = bool(frozen) and frozen[-1].final
        names += (keys.out(st.rid), keys.meta(st.rid))
        per_request += (gws.setdefault(st.gw, len(gws) + 1) if st.gw else 0, markers.get(st.rid, b""),
                        st.entry_id if final and not st.dead_letter else "",
                        concs.setdefault(st.key_id, len(concs) + 1) if final and st.key_id else 0, st.rid,
                        st.epoch, int(final), int(bool(frozen) and not st.ttl_set), len(frozen))
        for f in frozen:
            per_request += (f.entry_id, f.payload)
    per_gw: list = []
    for gw in gws:
        head = backlog.get(gw, ())
        per_gw += (int(refresh(gw)), len(head), *head)
    names += [keys.inbox(gw) for gw in gws]
    names.append(keys.requests)
    names += [keys.conc(key_id) for key_id in concs]
    return names, [s.output_maxlen, s.output_ttl_s, worker_id, len(call), len(gws), INBOX_MAXLEN, CONSUMER_GROUP,
                   s.output_ttl_s, *per_gw, *per_request]
