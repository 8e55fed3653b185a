"""The route key of a chat: conversations that share a long system prompt spread over the
workers, every turn of one conversation keeps its key (shared.routing)."""

from __future__ import annotations

from shared.routing import ROUTE_PREFIX_CHARS, rendezvous, route_key

SYSTEM = ("You are the support assistant of a large shop. Answer in full sentences, cite the "
          "policy section you rely on, never invent an order number. ") * 25      # ~3,000 chars


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question number {i}: where is my parcel?"}]


def test_a_long_shared_system_prompt_does_not_put_every_conversation_on_one_worker():
    assert len(SYSTEM) > ROUTE_PREFIX_CHARS
    keys = [route_key(None, None, conversation(i)) for i in range(16)]
    assert len(set(keys)) == 16
    placed = {rendezvous(k, ["w1", "w2"])[0] for k in keys}
    assert placed == {"w1", "w2"}


def test_every_turn_of_a_conversation_keeps_its_key_however_long_its_messages():
    for first_user in ("hi", "x" * (5 * ROUTE_PREFIX_CHARS)):
        opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first_user}]
        later = opening + [{"role": "assistant", "content": "yo " * 3000}, {"role": "user", "content": "and?"}]
        assert route_key(None, None, opening) == route_key(None, None, later)


def test_long_messages_are_told_apart_by_their_end_and_length():
    head = "h" * (3 * ROUTE_PREFIX_CHARS)
    keys = {route_key(None, None, [{"role": "user", "content": head + tail}]) for tail in ("a", "b", "ab")}
    assert len(keys) == 3
