"""The composition root of one gateway replica: where its parts are built and put together.

Holds this replica's random id (`gw_id`: its inbox `p:{g:<gw_id>}:inbox` and liveness entry),
the Redis clients, and the process-wide parts (inbox reader, submitter, admission, bookkeeper,
router, metrics, the open sessions, the housekeeping duties). It builds what each transport
gets, with exactly the collaborators it needs and never the hub itself:
* the one request core (gateway.request_core) both transports start, resume and cancel with;
* a WebSocket's session (`websocket_session`) and an HTTP request's (`http_session`), each a
  request table and a `Sender` over the transport's `Writer`;
* the fronts the endpoints reach (`WebSocketFront`, `HttpFront`) and the test/operations probe
  (gateway.probe), which gateway.app puts in the app's state at start;
* the Batch API's stores and its runner (gateway.batch), a housekeeping duty that runs each
  batch's lines through the same request core, on HTTP sessions like any other.
Nothing here is needed by another replica: losing the process loses no request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from redis.exceptions import RedisError

from gateway.admission import Admission
from gateway.auth import KeyChecker, OriginPolicy
from gateway.batch.files import FileStore
from gateway.batch.line import LineRunner
from gateway.batch.runner import BatchRunner
from gateway.batch.store import BatchStore
from gateway.bookkeeping import Bookkeeper
from gateway.heartbeats import HeartbeatWheel
from gateway.housekeeping import Housekeeping, gateway_duties
from gateway.inbox import Inbox
from gateway.liveness import Liveness, reqs_ttl_s
from gateway.metrics import GatewayMetrics
from gateway.new_request import RequestStarter
from gateway.openai.front import HttpFront
from gateway.openai.responses_store import ResponseStore
from gateway.openai.session import HttpSession
from gateway.openai.tokenize import WorkerAsk
from gateway.probe import GatewayProbe
from gateway.request_core import RequestCore
from gateway.request_log import CancelWatch
from gateway.requests import RequestTable
from gateway.resume import Resumer
from gateway.router import Router
from gateway.sender import Sender
from gateway.sessions import DRAIN_TIMEOUT_S, Sessions
from gateway.settings import GatewaySettings
from gateway.submit import Submitter
from gateway.wake import WakeEvent
from gateway.ws.connection import Connection
from gateway.ws.dispatch import MessageHandler
from gateway.ws.endpoint import WebSocketFront
from gateway.ws.socket import FrameSocket
from gateway.ws.socket_caps import SocketCaps, SocketClaim
from gateway.ws.tool_frames import ToolFrames
from shared.backlog import read_backlog
from shared.redis_client import connect
from shared.streams import Keys

log = logging.getLogger("gateway")


class Hub:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.keys = Keys(settings.stream_prefix)
        self.metrics = GatewayMetrics()
        self.cancel_watch = CancelWatch(self.metrics, expire_s=settings.cancel_fallback_s)
        self.key_checker = KeyChecker.from_settings(settings)
        self.origins = OriginPolicy(settings.allowed_origins)
        self.socket_caps = SocketCaps(per_key=settings.max_sockets_per_key, per_address=settings.max_sockets_per_address)
        self.heartbeats = HeartbeatWheel(settings.heartbeat_s)
        self.sessions = Sessions(self.heartbeats)
        self.gw_id = uuid.uuid4().hex[:16]      # random per process: a restart is a new gateway
        self.redis = None
        self.reader: Inbox | None = None
        self._reader_redis = None
        self.housekeeping: Housekeeping | None = None
        self.batch_runner: BatchRunner | None = None

    async def start(self) -> None:
        s = self.settings
        self.redis = connect(s.redis_url, max_connections=64)
        # the inbox reader sits in XREAD BLOCK on its own connection; its read timeout outlasts the block
        self._reader_redis = connect(s.redis_url, socket_timeout=s.inbox_block_ms / 1000 + 10)
        self.reader = Inbox(self._reader_redis, self.keys.inbox(self.gw_id), block_ms=s.inbox_block_ms,
                            on_unclaimed=self.cancel_watch.on_unclaimed)
        self.submitter = Submitter(self.redis, self.keys, self.gw_id, request_maxlen=s.request_stream_maxlen,
                                   output_ttl_s=s.output_ttl_s, concurrency=s.per_key_concurrency,
                                   rate_per_min=s.per_key_rate_per_min, lease_s=s.concurrency_lease_s,
                                   reqs_ttl_s=reqs_ttl_s(s.gateway_ttl_s, s.resume_grace_s))
        self.liveness = Liveness(self.redis, self.keys, self.gw_id, self.submitter, ttl_s=s.gateway_ttl_s,
                                 grace_s=s.resume_grace_s)
        self.admission = Admission(self.redis, self.keys, max_depth=s.max_queue_depth,
                                   worker_ttl_s=s.worker_ttl_s, cache_ms=s.admission_cache_ms)
        self.bookkeeper = Bookkeeper(self.submitter, grace_s=s.resume_grace_s,
                                     on_cancelled=self.metrics.cancels.labels("orphan").inc)
        self.router = Router(self.redis, self.keys, worker_ttl_s=s.worker_ttl_s, enabled=s.cache_routing)
        self.starter = RequestStarter(s, self.admission, self.submitter, self.bookkeeper, self.gw_id, self.router)
        self.resumer = Resumer(self.submitter)
        self._build_fronts()
        try:
            await self.liveness.beat()
            if self.router.enabled:   # route from the first request, not from housekeeping's first tick
                await self.router.refresh()
        except (RedisError, OSError) as exc:
            log.warning("first liveness beat or registry read failed (%s); housekeeping retries", exc)
        self.reader.start()
        self.bookkeeper.start()
        self.heartbeats.start()
        self.housekeeping.start()
        log.info("gateway %s started (inbox %s)", self.gw_id, self.keys.inbox(self.gw_id))

    def _build_fronts(self) -> None:
        """The request core over the parts, the duties, and what the endpoints and tests reach."""
        s = self.settings
        self.core = RequestCore(starter=self.starter, resumer=self.resumer, submitter=self.submitter,
                                sessions=self.sessions, metrics=self.metrics)
        files = FileStore(self.redis, self.keys, ttl_s=s.batch_file_ttl_s)
        batches = BatchStore(self.redis, self.keys, ttl_s=s.batch_file_ttl_s)
        responses = ResponseStore(self.redis, self.keys, self.submitter, s.responses_ttl_s)
        self.batch_runner = BatchRunner(
            self.redis, s, gw_id=self.gw_id, gateways_key=self.keys.gateways, store=batches, files=files,
            lines=LineRunner(self.core, self.http_session, batches, s.served_model_name, responses),
            draining=lambda: self.sessions.draining)
        self.housekeeping = Housekeeping(gateway_duties(
            s, sessions=self.sessions, cancel_watch=self.cancel_watch, submitter=self.submitter,
            liveness=self.liveness, router=self.router, metrics=self.metrics,
            read_backlog=self._read_backlog_metrics, batches=self.batch_runner.tick), self.metrics)
        self.websocket = WebSocketFront(core=self.core, key_checker=self.key_checker, origins=self.origins,
                                        socket_caps=self.socket_caps, settings=s, metrics=self.metrics,
                                        websocket_session=self.websocket_session)
        self.http = HttpFront(core=self.core, key_checker=self.key_checker, settings=s, metrics=self.metrics,
                              http_session=self.http_session,
                              ask_worker=WorkerAsk(self.reader, self.router, self.submitter, self.gw_id),
                              responses=responses,

                              files=files, batches=batches)
        self.probe = GatewayProbe(sessions=self.sessions, metrics=self.metrics, reader=self.reader,
                                  router=self.router, submitter=self.submitter, socket_caps=self.socket_caps,
                                  drain=self.drain)

    async def stop(self) -> None:
        await self.heartbeats.stop()
        if self.housekeeping:
            await self.housekeeping.stop()
        if self.batch_runner:
            await self.batch_runner.stop()        # its leases go now: another replica goes on at once
        if self.reader:
            await self.reader.stop()
        if self.redis:
            await self.admission.stop()
            await self.bookkeeper.stop()
            try:
                await asyncio.wait_for(self.liveness.leave(), 2.0)
            except (RedisError, OSError, asyncio.TimeoutError):
                pass  # survivors take over after gateway_ttl_s
            await self.redis.aclose()
        if self._reader_redis:
            await self._reader_redis.aclose()

    async def ready(self) -> bool:
        try:
            return bool(await self.redis.ping()) and self.reader.healthy and not self.draining
        except (RedisError, OSError):
            return False

    @property
    def draining(self) -> bool:
        return self.sessions.draining

    async def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        await self.sessions.drain(timeout)
        if self.batch_runner:
            await self.batch_runner.stop()

    async def _read_backlog_metrics(self) -> None:
        """The fleet as Redis shows it, for dashboards and alerts (one round trip every
        housekeeping.BACKLOG_METRICS_S): the backlog admission reads, and the live workers."""
        backlog = await read_backlog(self.redis, self.keys, self.settings.worker_ttl_s)
        # unknown (Redis cannot compute the group's lag): NaN, not a stale figure
        self.metrics.queue_depth.labels("queued").set(float("nan") if backlog.queued is None else backlog.queued)
        self.metrics.queue_depth.labels("pending").set(backlog.pending)
        self.metrics.live_workers.set(backlog.live_workers)

    # ---- building a session's parts -------------------------------------------------------------

    def request_table(self, wake: asyncio.Event) -> RequestTable:
        return RequestTable(wake, reader=self.reader, read_history=self.submitter.read_history,
                            bookkeeper=self.bookkeeper, metrics=self.metrics, settings=self.settings,
                            cancel_watch=self.cancel_watch)

    def websocket_session(self, socket: FrameSocket, *, key_id: str | None, claim: SocketClaim) -> Connection:
        wake = WakeEvent()       # set whenever the sender has something to do
        requests = self.request_table(wake)
        sender = Sender(socket, requests, wake, self.settings, self.metrics)
        socket.tools = ToolFrames(self.core.text_through)
        handler = MessageHandler(socket, sender, requests, settings=self.settings, metrics=self.metrics,
                                 key_checker=self.key_checker, core=self.core, key_id=key_id, claim=claim)
        return Connection(socket, requests, sender, handler, self.sessions, self.metrics)

    def http_session(self) -> HttpSession:
        """An HTTP request's session: its request table now (the request subscribes to its output
        before it is queued), its sender once the response it writes to exists."""
        wake = WakeEvent()       # set whenever the sender has something to do
        requests = self.request_table(wake)
        return HttpSession(requests, wake, self.sessions,
                           sender_for=lambda out: Sender(out, requests, wake, self.settings, self.metrics))
