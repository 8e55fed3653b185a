"""Chunk buffer policy: first token at once, then by time since the last flush or by token
count; a token after a long pause goes at once; 0 ms = per token; when the sender must be woken."""

import math

from gateway.flusher import ChunkBuffer
from gateway.wake import WakeEvent


def test_first_token_is_due_immediately_then_one_chunk_per_interval():
    buf = ChunkBuffer(interval_s=0.04, max_tokens=24)
    buf.add("a", 1, 1, now=10.0)
    assert buf.due(10.0)
    assert buf.take(10.0).text == "a"
    buf.add("b", 1, 2, now=10.02)
    buf.add("c", 1, 3, now=10.03)
    assert not buf.due(10.035)
    assert buf.deadline() == 10.04                 # interval counted from the last flush
    assert buf.due(10.04)
    chunk = buf.take(10.04)
    assert (chunk.text, chunk.tokens, chunk.seq) == ("bc", 2, 3)
    assert buf.empty and buf.take(10.05) is None and buf.deadline() is None


def test_token_after_a_pause_longer_than_the_interval_is_sent_at_once():
    buf = ChunkBuffer(interval_s=0.04, max_tokens=24)
    buf.add("a", 1, 1, now=0.0)
    buf.take(0.0)
    buf.add("b", 1, 2, now=0.5)
    assert buf.due(0.5)


def test_token_threshold_flushes_before_the_interval():
    buf = ChunkBuffer(interval_s=10.0, max_tokens=4)
    buf.add("x", 1, 1, now=0.0)
    buf.take(0.0)
    for i in range(2, 5):
        buf.add("y", 1, i, now=0.001 * i)
        assert not buf.due(0.01)
    buf.add("z", 1, 5, now=0.006)
    assert buf.due(0.006)
    assert buf.take(0.006).tokens == 4


def test_zero_interval_flushes_every_token_and_coalesces_a_backlog():
    buf = ChunkBuffer(interval_s=0.0, max_tokens=24)
    buf.add("a", 1, 1, now=1.0)
    buf.take(1.0)
    buf.add("b", 1, 2, now=1.0)
    assert buf.due(1.0)
    buf.add("c", 2, 3, now=1.0)     # sender was busy: the two events merge into one frame
    chunk = buf.take(1.0)
    assert (chunk.text, chunk.tokens, chunk.seq) == ("bc", 3, 3)


def test_a_sender_asleep_until_the_interval_ends_is_not_woken_for_the_next_token():
    """After a flush an empty buffer asks to be looked at when its interval ends: a sender
    sleeping until then is not woken for the tokens that arrive meanwhile (they are due exactly
    then), but is for one that arrives after it (due at once), for a token threshold reached
    early, and whenever it has no timer (a new buffer)."""
    wake = WakeEvent()
    buf = ChunkBuffer(interval_s=0.04, max_tokens=3)
    assert buf.look_at(10.0) is None and not wake.needed(buf.deadline())      # nothing buffered
    buf.add("a", 1, 1, now=10.0)
    assert wake.needed(buf.deadline())          # no task yet (until = +inf): the first token wakes it
    buf.take(10.0)
    assert buf.look_at(10.01) == 10.04          # the end of the interval the flush started
    wake.until = buf.look_at(10.01)             # the sender sleeps until then
    buf.add("b", 1, 2, now=10.02)
    assert buf.deadline() == 10.04 and not wake.needed(buf.deadline())
    buf.add("c", 1, 3, now=10.025)
    buf.add("d", 1, 4, now=10.03)               # the threshold: due now, before the timer
    assert wake.needed(buf.deadline())
    buf.take(10.03)
    assert buf.look_at(10.08) is None           # the interval ended without a token: no timer
    wake.until = math.inf
    buf.add("e", 1, 5, now=10.09)
    assert wake.needed(buf.deadline()) and buf.due(10.09)
    wake.until = -math.inf                      # a sender that runs looks at every buffer anyway
    assert not wake.needed(buf.deadline())
    assert ChunkBuffer(interval_s=0.0, max_tokens=3).look_at(1.0) is None
