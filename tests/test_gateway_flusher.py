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


def test_a_pass_takes_nearly_due_buffers_along_so_a_sockets_streams_fall_into_step():
    """Two streams of one socket, first flushed 8 ms apart, tokens every 5 ms: passes run when a
    buffer is due (as gateway.sender schedules them). Taking along what is due within a quarter
    interval puts both on one pass (one socket write) from the second interval on, and no chunk
    comes sooner than 30 ms or later than the interval after the last."""
    bufs = [ChunkBuffer(interval_s=0.04, max_tokens=32) for _ in range(2)]
    sent: list[list[float]] = [[], []]
    passes = []
    seq = 0
    for i, first in enumerate((0.0, 0.008)):
        bufs[i].add("a", 1, 1, now=first)
        sent[i].append(first)
        bufs[i].take(first)
    for ms in range(1, 1001):                               # a millisecond clock; a token every 5 ms
        t = ms / 1000
        if ms % 5 == 0:
            seq += 1
            for b in bufs:
                b.add("x", 1, seq, now=t)
        if any(b.due(t) for b in bufs):                     # a pass runs: it takes along what is nearly due
            passes.append(t)
            for i, b in enumerate(bufs):
                if b.due_in_pass(t):
                    sent[i].append(t)
                    b.take(t)
    assert sent[0][2:] == sent[1][2:]                       # in step after the first interval
    assert len(passes) == len(sent[0]) - 1                  # one pass a chunk: both go in it
    for times in sent:
        gaps = [b - a for a, b in zip(times[1:], times[2:])]
        assert all(0.03 - 1e-9 <= g <= 0.041 for g in gaps), gaps    # (+1 ms: the clock's resolution)


def test_without_the_pass_slack_the_same_streams_keep_their_own_phase():
    """The contrast: with `due` alone each stream keeps its phase: two passes an interval."""
    bufs = [ChunkBuffer(interval_s=0.04, max_tokens=32) for _ in range(2)]
    for i, first in enumerate((0.0, 0.008)):
        bufs[i].add("a", 1, 1, now=first)
        bufs[i].take(first)
    passes = 0
    for ms in range(1, 1001):
        t = ms / 1000
        if ms % 5 == 0:
            for b in bufs:
                b.add("x", 1, 2, now=t)
        due = [b for b in bufs if b.due(t)]
        passes += bool(due)
        for b in due:
            b.take(t)
    assert passes >= 45                                     # ~2 a 40 ms interval over 1 s
