"""Chunk buffer policy: first token at once, then by age or by token count; 0 ms = per token."""

from gateway.flusher import ChunkBuffer


def test_first_token_is_due_immediately_then_time_threshold():
    buf = ChunkBuffer(interval_s=0.04, max_tokens=24)
    buf.add("a", 1, 1, now=10.0)
    assert buf.due(10.0)
    assert buf.take().text == "a"
    buf.add("b", 1, 2, now=10.001)
    buf.add("c", 1, 3, now=10.02)
    assert not buf.due(10.03)
    assert buf.deadline() == 10.001 + 0.04
    assert buf.due(10.041 + 0.001)
    chunk = buf.take()
    assert (chunk.text, chunk.tokens, chunk.seq) == ("bc", 2, 3)
    assert buf.empty and buf.take() is None and buf.deadline() is None


def test_token_threshold_flushes_before_the_interval():
    buf = ChunkBuffer(interval_s=10.0, max_tokens=4)
    buf.add("x", 1, 1, now=0.0)
    buf.take()
    for i in range(2, 5):
        buf.add("y", 1, i, now=0.001 * i)
        assert not buf.due(0.01)
    buf.add("z", 1, 5, now=0.006)
    assert buf.due(0.006)
    assert buf.take().tokens == 4


def test_zero_interval_flushes_every_token_and_coalesces_a_backlog():
    buf = ChunkBuffer(interval_s=0.0, max_tokens=24)
    buf.add("a", 1, 1, now=1.0)
    buf.take()
    buf.add("b", 1, 2, now=1.0)
    assert buf.due(1.0)
    buf.add("c", 2, 3, now=1.0)     # sender was busy: the two events merge into one frame
    chunk = buf.take()
    assert (chunk.text, chunk.tokens, chunk.seq) == ("bc", 3, 3)
