"""What every client session is to the rest of the gateway: a WebSocket (gateway.ws.connection)
or one HTTP response (gateway.openai.session), each streaming requests.

Why a protocol of its own, in a module that imports nothing of the gateway: the process-wide
parts (heartbeat wheel, slow-consumer and stall watchdogs, lease refresh, drain) act on every
session alike and must not know which transport it is, nor import it. gateway.sessions holds
the shared implementation and the registry of open sessions.
"""

from __future__ import annotations

from typing import Protocol


class Session(Protocol):
    closed: bool

    @property
    def last_send(self) -> float: ...

    def heartbeat(self) -> None: ...

    def shut_down(self) -> None: ...

    def check_slow(self, now: float) -> None: ...

    def end_stalled(self, now: float, stall_s: float) -> list[str]: ...

    def held_slots(self) -> list[tuple[str, str]]: ...
