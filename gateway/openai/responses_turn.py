"""One Responses API turn made ready to run: its body and the stored chain it continues
(`previous_response_id`) -> the `generate` message and the response to store.

Shared by `POST /v1/responses` (gateway.openai.responses_routes) and a Batch API line for
`/v1/responses` (gateway.batch.line), so that a response runs the same whichever way it came in.
The stored response is named after the request that runs it (`turn.stored(rid)`): a batch line
that re-attaches to the request a replica already started (its idempotency key) is that request's
response, whatever id it would have had.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.openai import responses_body as rb
from gateway.openai.errors import APIError
from gateway.openai.responses_store import PREFIX, ResponseStore, Stored
from shared.errors import ProtocolError
from shared.protocol import Generate, parse_client_message

FINISHED = ("completed", "incomplete", "failed", "cancelled")


@dataclass
class Turn:
    body: rb.ResponsesBody
    key_id: str
    model: str
    fields: dict                  # the `generate` fields, without id
    conversation: list[dict]
    mode: str | None

    def message(self, client_id: str, **extra) -> Generate:
        """The `generate` (a 400 APIError for one the protocol refuses); `extra`: more fields."""
        try:
            return parse_client_message({"type": "generate", "id": client_id, **self.fields, **extra})
        except ProtocolError as exc:
            raise APIError(400, exc.message, code=exc.code.value) from None

    def stored(self, rid: str) -> Stored:
        """The response of request `rid`, as stored (and as its events are numbered)."""
        return Stored(hex=rid, key_id=self.key_id, base=rb.base_object(self.body, PREFIX + rid, self.model),
                      conversation=self.conversation, input=rb.input_items(self.body.input, rid), mode=self.mode,
                      logprobs=bool(self.fields.get("logprobs")), final=None, cancelled=False)


async def prepare(store: ResponseStore, body: rb.ResponsesBody, key_id: str, model: str) -> Turn:
    """The turn of `body` for `key_id` (a 404 APIError for a previous response it cannot see, a
    400 for one still running); Redis errors pass through."""
    history: list[dict] = []
    if body.previous_response_id is not None:
        prev = await store.load(body.previous_response_id, key_id)
        if prev is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                           code="not_found", param="previous_response_id")
        current = await store.current(prev)
        if current["status"] not in FINISHED:
            raise APIError(400, f"Previous response '{body.previous_response_id}' is still "
                                f"{current['status']}", param="previous_response_id")
        history = prev.conversation + rb.output_messages(current["output"])
    fields, conversation, mode = rb.generate_fields(body, history)
    return Turn(body=body, key_id=key_id, model=model, fields=fields, conversation=conversation, mode=mode)
