"""The history/live join on its own (gateway.stream_join): every interleaving a gateway can see."""

from __future__ import annotations

import random

from gateway.stream_join import StreamJoin
from shared.errors import ErrorCode
from shared.events import DoneEvent, ErrEvent, HistoryEvent, TokEvent


def tok(seq: int, n: int = 1, ep: int = 1, *, lens: bool = True) -> TokEvent:
    """Tokens seq-n+1..seq, token i's text "<i>" (with per-token text lengths unless `lens` is
    False: an event written before they existed)."""
    texts = [f"<{i}>" for i in range(seq - n + 1, seq + 1)]
    return TokEvent("r", seq, list(range(seq - n + 1, seq + 1)), "".join(texts), ep, 0, None, 0,
                    [len(t) for t in texts] if lens else None)


def texts(events: list[HistoryEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TokEvent))


def done(seq: int, ep: int = 1) -> DoneEvent:
    return DoneEvent("r", seq, "stop", None, ep)


def history_after(history: list[HistoryEvent], after: int) -> list[HistoryEvent]:
    """What a read of the history after token `after` returns (gateway.submit.read_history)."""
    return [e for e in history if (isinstance(e, TokEvent) and e.seq > after) or (e.is_final and e.seq >= after)]


def seqs(events: list[HistoryEvent]) -> list:
    return [(e.KIND, e.seq) for e in events]


def lost(out: list[HistoryEvent], j: StreamJoin) -> bool:
    """The join ended with a gap: its final is the retryable output_lost error, delivered last."""
    return (j.gap is not None and out[-1] is j.final and isinstance(out[-1], ErrEvent)
            and out[-1].code == "output_lost" and out[-1].retryable and out[-1].seq == j.delivered)


def test_live_in_order_with_duplicates():
    j = StreamJoin()
    out = j.live(tok(2, 2)) + j.live(tok(2, 2)) + j.live(tok(5, 3)) + j.live(tok(4, 2)) + j.live(done(5))
    assert seqs(out) == [("tok", 2), ("tok", 5), ("done", 5)]
    assert j.final is not None and j.gap is None and not j.wants_read
    assert j.live(tok(6)) == []                       # nothing after the final


def test_a_live_event_past_the_next_token_waits_for_the_history():
    history = [tok(2, 2), tok(4, 2), tok(7, 3), done(7)]
    j = StreamJoin()
    out = j.live(tok(2, 2))
    out += j.live(tok(7, 3))                          # 3-4 never came live (e.g. a stale writer crossed)
    assert j.wants_read and seqs(out) == [("tok", 2)]
    out += j.live(done(7))                            # held too: tokens are missing before it
    after = j.start_read()
    assert after == 2
    out += j.history(history_after(history, after))
    assert seqs(out) == [("tok", 2), ("tok", 4), ("tok", 7), ("done", 7)]
    assert j.gap is None


def test_resume_holds_live_until_the_marker_then_joins_history_and_live_without_duplicates():
    history = [tok(3, 3), tok(6, 3), tok(8, 2)]
    j = StreamJoin(3, attaching=True)                 # the client has tokens 1-3
    assert j.live(tok(8, 2)) == [] and j.live(tok(10, 2)) == []    # live before the marker: held
    assert not j.wants_read
    j.marker()
    assert j.wants_read
    out = j.history(history_after(history, j.start_read()))
    assert seqs(out) == [("tok", 6), ("tok", 8), ("tok", 10)]
    out = j.live(tok(10, 2)) + j.live(tok(11)) + j.live(done(11))
    assert seqs(out) == [("tok", 11), ("done", 11)]


def test_a_read_while_still_attaching_delivers_history_only():
    """No owner yet at resume: the history is read at once; live waits for the marker."""
    j = StreamJoin(0, attaching=True)
    assert j.live(tok(3, 1)) == []
    j.start_read()
    out = j.history([tok(1), tok(2)])
    assert seqs(out) == [("tok", 1), ("tok", 2)]
    assert not j.wants_read and j.gap is None
    j.marker()
    out = j.history(history_after([tok(1), tok(2), tok(3)], j.start_read()))
    assert seqs(out) == [("tok", 3)]


def test_trimmed_history_is_a_gap_not_a_jump():
    j = StreamJoin(5, attaching=True)
    j.marker()
    out = j.history(history_after([tok(12, 2), tok(14, 2)], j.start_read()))   # tokens 6-10 are gone
    assert seqs(out) == [("err", 5)] and lost(out, j) and "6-10" in j.gap and j.ended


def test_a_held_event_the_next_read_cannot_explain_is_a_gap():
    j = StreamJoin()
    j.live(tok(1))
    j.live(tok(5, 2))                                 # 2-3 missing: held
    j.start_read()                                    # a read that started after it was held...
    out = j.history([tok(2)])                         # ...brings 2, but not 3: history lost it
    assert seqs(out) == [("tok", 2), ("err", 2)] and lost(out, j) and "3-3" in j.gap
    assert j.live(tok(6)) == []                       # ended


def test_an_event_that_arrived_during_a_read_gets_another_read():
    j = StreamJoin()
    j.live(tok(1))
    j.live(tok(3))                                    # 2 missing
    j.start_read()
    j.live(tok(5))                                    # arrives while the read is in flight
    out = j.history([tok(2), tok(3)])                 # this read predates token 4 and 5
    assert seqs(out) == [("tok", 2), ("tok", 3)]
    assert j.wants_read and j.gap is None             # 5 is held for another read, not a gap
    out = j.history(history_after([tok(1), tok(2), tok(3), tok(4), tok(5)], j.start_read()))
    assert seqs(out) == [("tok", 4), ("tok", 5)]


def test_unreadable_history_is_a_gap():
    j = StreamJoin(4, attaching=True)
    j.marker()
    j.start_read()
    out = j.history(None)
    assert seqs(out) == [("err", 4)] and lost(out, j)


def test_a_resume_inside_an_event_gets_the_events_tail():
    history = [tok(2, 2), tok(6, 4), done(6)]
    j = StreamJoin(3, attaching=True)                 # the client has tokens 1-3: inside 3-6
    j.marker()
    out = j.history(history_after(history, j.start_read()))
    assert seqs(out) == [("tok", 6), ("done", 6)] and j.gap is None
    assert out[0].ids == [4, 5, 6] and out[0].text == "<4><5><6>" and out[0].lens == [3, 3, 3]
    assert history[1].ids == [3, 4, 5, 6]            # the history's event itself is left whole


def test_a_live_event_around_the_resume_point_is_cut_too():
    j = StreamJoin(3)
    out = j.live(tok(5, 4)) + j.live(tok(7, 2)) + j.live(done(7))
    assert texts(out) == "<4><5><6><7>" and seqs(out) == [("tok", 5), ("tok", 7), ("done", 7)]


def test_an_old_event_with_text_and_no_lengths_inside_is_a_gap_at_its_boundary_it_is_not():
    j = StreamJoin(3)
    out = j.live(tok(5, 4, lens=False))
    assert lost(out, j) and "overlaps" in j.gap and j.delivered == 3
    j = StreamJoin(1)                                 # at its boundary: delivered whole
    out = j.live(tok(5, 4, lens=False))
    assert texts(out) == "<2><3><4><5>" and j.gap is None
    j = StreamJoin(3)                                 # no text to cut: ids alone are cut
    out = j.live(TokEvent("r", 5, [2, 3, 4, 5], "", 1, 0))
    assert out[0].ids == [4, 5] and j.gap is None


def test_a_resume_past_the_end_of_the_output_is_refused_not_left_waiting():
    j = StreamJoin(9, attaching=True)
    j.marker()
    j.start_read()
    out = j.history([done(6)])                        # what a read past the end returns: the final
    assert j.ended and j.gap is None and isinstance(out[-1], ErrEvent) and out[-1].code == "invalid_request"


def test_an_overlap_after_the_resume_point_is_still_a_gap():
    """Only the point where the join began may fall inside an event; an event overlapping tokens
    delivered since would splice two writers' outputs."""
    j = StreamJoin()
    out = j.live(tok(3, 3)) + j.live(tok(5, 3))
    assert lost(out, j) and j.delivered == 3


def test_a_final_with_tokens_missing_in_history_is_a_gap():
    j = StreamJoin(2, attaching=True)
    j.marker()
    out = j.history(history_after([tok(2, 2), done(6)], j.start_read()))
    assert lost(out, j) and "3-6" in j.gap


def test_epoch_change_mid_join_drops_the_stale_writers_events():
    j = StreamJoin()
    out = j.live(tok(2, 2, ep=1)) + j.live(tok(4, 2, ep=2))      # the continuation (epoch 2) goes on
    out += j.live(tok(6, 2, ep=1))                               # a stale writer's late live copy
    assert seqs(out) == [("tok", 2), ("tok", 4)] and j.stale == 1
    out = j.live(tok(6, 2, ep=2)) + j.live(done(6, ep=2))
    assert seqs(out) == [("tok", 6), ("done", 6)]


def test_history_spanning_two_epochs_is_one_stream():
    j = StreamJoin(0, attaching=True)
    j.marker()
    out = j.history(history_after([tok(3, 3, ep=1), tok(5, 2, ep=2)], j.start_read()))
    assert seqs(out) == [("tok", 3), ("tok", 5)] and j.epoch == 2
    assert j.live(tok(3, 3, ep=1)) == [] and j.stale == 1
    assert seqs(j.live(done(5, ep=2))) == [("done", 5)]


def test_reordered_inbox_events():
    j = StreamJoin()
    out = j.live(tok(10, 5))                          # 6-10 before 1-5
    assert out == [] and j.wants_read
    out += j.live(tok(5, 5))                          # before the read starts: it fits at once
    out += j.history(history_after([tok(5, 5), tok(10, 5)], j.start_read()))
    assert seqs(out) == [("tok", 5), ("tok", 10)]


def test_a_gateway_side_end_wins_once():
    j = StreamJoin()
    assert j.end_here(DoneEvent.here("r", 0, "cancelled"))
    assert not j.end_here(ErrEvent.here("r", 0, ErrorCode.STALLED, "no output"))
    assert j.live(tok(1)) == []


def test_random_interleavings_deliver_every_token_once_in_order_or_end_with_a_gap():
    """A worker's events (two epochs), live copies lost, duplicated, delayed and reordered, reads
    at random moments, a resume from anywhere, and sometimes a history that lost its start:
    the join delivers exactly the history from the resume point on, or stops with a gap and
    never delivers anything out of place."""
    rng = random.Random(26)
    for case in range(3000):
        events, seq = [], 0
        switch = rng.randrange(1, 8)                  # the event index where epoch 2 takes over
        for i in range(rng.randrange(1, 12)):
            n = rng.randrange(1, 4)
            seq += n
            events.append(tok(seq, n, ep=1 if i < switch else 2))
        events.append(done(seq, ep=2 if len(events) > switch else 1))
        bounds = [0] + [e.seq for e in events if isinstance(e, TokEvent)]
        start = rng.randrange(seq + 1)                # resume from any token, inside an event or not
        lost_before = rng.choice([0] * 3 + bounds)    # the history lost everything up to here
        history = [e for e in events if not isinstance(e, TokEvent) or e.seq - e.n >= lost_before]
        live = []
        for e in events:                              # live copies: lost, duplicated, late
            if rng.random() < 0.25:
                continue
            live.append(e)
            if rng.random() < 0.2:
                live.append(e)
        for _ in range(rng.randrange(0, 3)):
            if len(live) > 1:
                i = rng.randrange(len(live) - 1)
                live[i], live[i + 1] = live[i + 1], live[i]
        resume = start > 0 or rng.random() < 0.3
        j = StreamJoin(start, attaching=resume)
        out: list[HistoryEvent] = []
        pending_read: int | None = None
        marker_at = rng.randrange(len(live) + 1) if resume else -1
        steps = list(live) + [None] * 4               # None: nothing arrives, time passes
        for i, ev in enumerate(steps):
            if i == marker_at:
                j.marker()
            if ev is not None:
                out += j.live(ev)
            if j.wants_read and pending_read is None and not j.reading:
                pending_read = j.start_read()
            if pending_read is not None and rng.random() < 0.5:
                out += j.history(history_after(history, pending_read))
                pending_read = None
        while not j.ended:      # lost live copies of the last events: a later read finds them
            if j.attaching:
                j.marker()
            if pending_read is None:
                pending_read = j.start_read()
            out += j.history(history_after(history, pending_read))
            pending_read = None
        expected = [e if not isinstance(e, TokEvent) or e.first > start else e.tail(start)
                    for e in events if not isinstance(e, TokEvent) or e.seq > start]
        if j.gap is None:
            assert out == expected, (case, start, lost_before, seqs(out), seqs(expected))
        else:
            assert lost_before > start, (case, j.gap)
            assert lost(out, j)
            assert out[:-1] == expected[:len(out) - 1], (case, seqs(out), seqs(expected))    # a prefix, no jump
