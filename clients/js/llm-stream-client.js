// llm-stream client for browsers (and any runtime with a WHATWG WebSocket): one socket, many
// concurrent requests, automatic reconnect and resume. ES module, no dependencies, no build step.
//
//   import {StreamClient} from "/clients/js/llm-stream-client.js";
//   const client = new StreamClient("wss://host/v1/stream", {apiKey});
//   for await (const chunk of client.generate({prompt: "Hi", max_tokens: 40})) show(chunk.text);
//
// When the socket drops (network change, a gateway killed or restarting, a slow-consumer close)
// the client reconnects with exponential backoff and full jitter — at once after close 1012 —,
// sends `resume` with the last `seq` it delivered and the `request_id` from `accepted` for every
// unfinished request, and drops chunks it has already delivered, so the caller's iteration just
// continues with exactly the uninterrupted text. A request never `accepted` is sent again.
// Protocol: docs/protocol.md. Guide: docs/clients.md. The Python SDK (clients/python) mirrors it.

const SUBPROTOCOL = "llm-stream.json";
const CLOSE_POLICY = 1008;           // unauthorized / origin not allowed: do not retry
const CLOSE_SERVICE_RESTART = 1012;  // the server asked for a reconnect now
const FATAL_CODES = new Set(["unauthorized", "origin_not_allowed"]);

/** `bytes` random bytes as hex (crypto.getRandomValues: browsers and Node 19+). */
function randomHex(bytes) {
  const buf = new Uint8Array(bytes);
  globalThis.crypto.getRandomValues(buf);
  return Array.from(buf, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** Base class of everything a request can fail with; switch on the class or `code`. */
export class LLMStreamError extends Error {
  constructor(code, message, {retryable = false, id = null} = {}) {
    super(`${code}: ${message}`);
    this.name = new.target.name;
    this.code = code;
    this.detail = message;
    this.retryable = retryable;
    this.id = id;
  }
}
/** An `error` frame for the request: it was not started (or not resumed). */
export class RequestRefused extends LLMStreamError {}
/** Nothing is retained for the request any more (a reconnect came too late). */
export class ResumeExpired extends RequestRefused {}
/** `done` with `finish_reason: "error"`; retrying (if `retryable`) is the caller's choice. */
export class GenerationFailed extends LLMStreamError {}
/** Wrong or missing API key / origin (close 1008); never retried. */
export class Unauthorized extends LLMStreamError {}
/** Reconnecting failed `maxReconnectAttempts` times in a row, or the client was closed. */
export class ConnectionLost extends LLMStreamError {}

/** One request: `for await (const chunk of generation)` yields {text, seq, tokens}. */
export class Generation {
  constructor(client, req) {
    this._client = client;
    this._req = req;
    this.text = "";          // everything yielded so far
    this.result = null;      // {finishReason, usage, seq} once ended normally
  }
  get id() { return this._req.id; }
  get requestId() { return this._req.requestId; }

  async next() {
    if (this.result) return {done: true, value: undefined};
    const item = await this._req.take();
    if (item.kind === "chunk") {
      this.text += item.chunk.text;
      return {done: false, value: item.chunk};
    }
    if (item.kind === "result") {
      this.result = item.result;
      return {done: true, value: undefined};
    }
    throw item.error;
  }
  [Symbol.asyncIterator]() { return this; }

  /** Iterate to the end and return the whole text. */
  async collect() {
    for await (const _ of this) { /* text accumulates */ }
    return this.text;
  }
  /** Stop the request; iteration then ends with `result.finishReason === "cancelled"`. */
  cancel() { this._client.cancel(this.id); }
}

class Request {
  constructor(id, body) {
    this.id = id;
    this.body = body;           // the `generate` message
    this.requestId = null;      // from `accepted`; needed to resume
    this.lastSeq = 0;           // seq of the last chunk handed to the caller
    this.sentOn = null;         // connection number the generate/resume went out on
    this.cancelRequested = false;
    this.cancelSentOn = null;
    this.resumeFailures = 0;
    this.finished = false;
    this._items = [];
    this._waiter = null;
  }
  push(item) {
    if (this._waiter) { const w = this._waiter; this._waiter = null; w(item); } else this._items.push(item);
  }
  take() {
    if (this._items.length) return Promise.resolve(this._items.shift());
    return new Promise((resolve) => { this._waiter = resolve; });
  }
}

/**
 * A resuming client. `url`: one URL (normally the load balancer) or an array tried in turn after
 * a failed attempt. `apiKey` is sent as the first `{type: "auth"}` message (browsers cannot set
 * headers on a WebSocket). `onStatus(state)` hears "connecting", "connected", "reconnecting",
 * "disconnected".
 */
export class StreamClient {
  constructor(url, {apiKey = null, backoffBaseMs = 250, backoffMaxMs = 30000, maxReconnectAttempts = 10,
                    idleTimeoutMs = 40000, onStatus = null, WebSocketImpl = globalThis.WebSocket} = {}) {
    this.urls = Array.isArray(url) ? url.slice() : [url];
    this.apiKey = apiKey;
    this.backoffBaseMs = backoffBaseMs;
    this.backoffMaxMs = backoffMaxMs;
    this.maxReconnectAttempts = maxReconnectAttempts;
    this.idleTimeoutMs = idleTimeoutMs;
    this.onStatus = onStatus;
    this.WebSocketImpl = WebSocketImpl;
    this.reconnects = 0;        // sockets opened after the first one
    this._requests = new Map();
    this._ws = null;
    this._conn = 0;
    this._urlIndex = 0;
    this._attempt = 0;
    this._opened = false;       // a socket was ever opened (so the next one is a reconnect)
    this._live = false;         // the current socket answered (auth passed)
    this._connecting = false;
    this._timer = null;         // pending reconnect
    this._idle = null;          // idle watchdog
    this._fatal = null;
    this._closed = false;
    this._ready = [];           // resolvers of connect()
    this._counter = 0;
    this._prefix = Math.random().toString(36).slice(2, 10);
  }

  get connected() { return this._ws !== null && this._ws.readyState === 1; }

  /** Resolves once a socket is open and answered a ping; rejects with Unauthorized/ConnectionLost. */
  connect() {
    if (this._fatal) return Promise.reject(this._fatal);
    if (this._live) return Promise.resolve();
    return new Promise((resolve, reject) => {
      this._ready.push({resolve, reject});
      this._open();
    });
  }

  /** Start a request: `{prompt}` or `{messages}` plus generate fields (max_tokens, temperature,
   *  top_p, top_k, seed, stop, priority, idempotency_key: a random one by default) and an
   *  optional `id`. */
  generate(params) {
    if (this._closed) throw new ConnectionLost("closed", "the client is closed");
    const {id, ...fields} = params;
    if ((fields.prompt === undefined) === (fields.messages === undefined)) {
      throw new TypeError("give exactly one of prompt or messages");
    }
    const cid = id || `j${this._prefix}-${++this._counter}`;
    if (this._requests.has(cid)) throw new TypeError(`request ${cid} is still running on this client`);
    const body = {type: "generate", id: cid};
    for (const [k, v] of Object.entries(fields)) if (v !== undefined && v !== null) body[k] = v;
    // 128 random bits, sent again unchanged if `accepted` is lost: the server attaches, not reruns
    if (body.idempotency_key === undefined) body.idempotency_key = randomHex(16);
    const req = new Request(cid, body);
    this._requests.set(cid, req);
    const gen = new Generation(this, req);
    if (this._fatal) { this._finish(req, {kind: "error", error: this._fatal}); return gen; }
    if (this.connected) this._sync(req); else this._open();
    return gen;
  }

  /** Cancel a running request (no-op once it has ended). */
  cancel(id) {
    const req = this._requests.get(id);
    if (!req || req.finished) return;
    req.cancelRequested = true;
    if (req.requestId === null && req.sentOn === null) {   // never left the page
      this._finish(req, {kind: "result", result: {finishReason: "cancelled", usage: {}, seq: req.lastSeq}});
      return;
    }
    if (this.connected) this._sync(req);
  }

  /** Close the socket; unfinished requests end with ConnectionLost (the server cancels them). */
  close() {
    this._closed = true;
    clearTimeout(this._timer);
    this._drop(this._ws);
    this._failAll(new ConnectionLost("closed", "the client was closed"));
  }

  // ---------------------------------------------------------------- connection

  _status(state) { if (this.onStatus) this.onStatus(state); }

  _backoff() {  // full jitter: random(0, min(max, base * 2^attempt))
    return Math.random() * Math.min(this.backoffMaxMs, this.backoffBaseMs * 2 ** this._attempt);
  }

  _open() {
    if (this._closed || this._fatal || this._ws || this._connecting || this._timer) return;
    this._connecting = true;
    this._status(this._opened ? "reconnecting" : "connecting");
    const url = this.urls[this._urlIndex % this.urls.length];
    let ws;
    try {
      ws = new this.WebSocketImpl(url, [SUBPROTOCOL]);
    } catch (e) {
      this._connecting = false;
      this._failedAttempt(e);
      return;
    }
    const conn = ++this._conn;
    let progressed = false, restart = false;
    ws.onopen = () => {
      this._connecting = false;
      this._ws = ws;
      if (this._opened) this.reconnects += 1;
      this._opened = true;
      this._touch(ws);
      if (this.apiKey) ws.send(JSON.stringify({type: "auth", api_key: this.apiKey}));
      ws.send(JSON.stringify({type: "ping", nonce: conn}));   // the pong proves auth passed
      for (const req of this._requests.values()) this._sync(req);
    };
    ws.onmessage = (ev) => {
      if (this._ws !== ws) return;
      this._touch(ws);
      let msg;
      try { msg = JSON.parse(ev.data); } catch (e) { return; }
      if (!msg || typeof msg !== "object") return;
      if (msg.type !== "error" && !progressed) {
        progressed = true;
        this._live = true;
        this._attempt = 0;
        this._status("connected");
        for (const r of this._ready.splice(0)) r.resolve();
      }
      if (msg.type === "error" && msg.id == null) {
        if (FATAL_CODES.has(msg.code)) this._fatal = new Unauthorized(msg.code, msg.message || "");
        else if (msg.code === "shutting_down") restart = true;
        return;
      }
      this._dispatch(msg);
    };
    ws.onclose = (ev) => {
      if (ws._llmDropped) return;              // already handled (idle watchdog / close())
      this._connecting = false;
      this._lost(ws, ev.code, progressed, restart);
    };
    ws.onerror = () => { /* onclose follows */ };
  }

  _touch(ws) {
    clearTimeout(this._idle);
    this._idle = setTimeout(() => {            // nothing, not even a heartbeat: the socket is dead
      if (this._ws === ws) { this._drop(ws); this._lost(ws, 1006, true, false); }
    }, this.idleTimeoutMs);
  }

  _drop(ws) {
    if (!ws) return;
    ws._llmDropped = true;
    clearTimeout(this._idle);
    try { ws.close(); } catch (e) { /* already closing */ }
    if (this._ws === ws) { this._ws = null; this._live = false; }
  }

  _lost(ws, code, progressed, restart) {
    if (this._ws === ws) this._ws = null;
    this._live = false;
    clearTimeout(this._idle);
    if (this._closed) return;
    this._status("disconnected");
    if (code === CLOSE_POLICY && !this._fatal) this._fatal = new Unauthorized("unauthorized", "policy violation");
    if (this._fatal) {
      for (const r of this._ready.splice(0)) r.reject(this._fatal);
      this._failAll(this._fatal);
      return;
    }
    if ((restart || code === CLOSE_SERVICE_RESTART) && progressed) {
      this._attempt = 0;                         // the server asked: reconnect now
      this._open();
      return;
    }
    this._failedAttempt(new Error(`socket closed (${code})`));
  }

  _failedAttempt(err) {
    this._urlIndex += 1;
    this._attempt += 1;
    if (this._attempt > this.maxReconnectAttempts) {
      const lost = new ConnectionLost("connection_lost", `gave up reconnecting: ${err.message}`, {retryable: true});
      for (const r of this._ready.splice(0)) r.reject(lost);
      this._failAll(lost);
      this._attempt = 0;                         // the next generate() tries again
      return;
    }
    if (this._requests.size === 0 && this._ready.length === 0) return;   // nothing waits: reconnect lazily
    this._timer = setTimeout(() => { this._timer = null; this._open(); }, this._backoff());
  }

  // ---------------------------------------------------------------- per request

  _sync(req) {
    const ws = this._ws;
    if (!ws || ws.readyState !== 1 || req.finished) return;
    const out = [];
    if (req.sentOn !== this._conn) {
      req.sentOn = this._conn;
      out.push(req.requestId === null ? req.body
        : {type: "resume", id: req.id, last_seq: req.lastSeq, request_id: req.requestId});
    }
    if (req.cancelRequested && req.cancelSentOn !== this._conn) {
      req.cancelSentOn = this._conn;
      out.push({type: "cancel", id: req.id});
    }
    for (const msg of out) ws.send(JSON.stringify(msg));
  }

  _dispatch(msg) {
    const req = this._requests.get(msg.id);
    if (!req || req.finished) return;
    if (msg.type === "accepted") {
      req.requestId = msg.request_id || req.requestId;
      req.resumeFailures = 0;
    } else if (msg.type === "chunk") {
      if (msg.seq <= req.lastSeq) return;        // already delivered before a reconnect
      req.lastSeq = msg.seq;
      req.push({kind: "chunk", chunk: {text: msg.text, seq: msg.seq, tokens: msg.tokens}});
    } else if (msg.type === "done") {
      if (msg.finish_reason === "error") {
        const e = msg.error || {};
        this._finish(req, {kind: "error", error: new GenerationFailed(e.code || "internal", e.message || "",
                                                                      {retryable: !!e.retryable, id: req.id})});
      } else {
        this._finish(req, {kind: "result", result: {finishReason: msg.finish_reason, usage: msg.usage || {},
                                                    seq: msg.seq}});
      }
    } else if (msg.type === "error") {
      this._refused(req, msg);
    }
  }

  _refused(req, msg) {
    const code = msg.code || "internal", retryable = !!msg.retryable;
    if (code === "unknown_id" && req.cancelRequested) return;    // the cancel crossed the end
    if (code === "shutting_down") { req.sentOn = null; return; }  // the next connection sends it again
    if (code === "resume_expired") {
      this._finish(req, {kind: "error", error: new ResumeExpired(code, msg.message || "", {id: req.id})});
      return;
    }
    if (retryable && req.requestId !== null && req.resumeFailures < this.maxReconnectAttempts) {
      req.resumeFailures += 1;                   // e.g. a limit still counting the old socket
      req.sentOn = null;
      const delay = Math.random() * Math.min(this.backoffMaxMs, this.backoffBaseMs * 2 ** req.resumeFailures);
      setTimeout(() => this._sync(req), delay);
      return;
    }
    this._finish(req, {kind: "error", error: new RequestRefused(code, msg.message || "", {retryable, id: req.id})});
  }

  _finish(req, item) {
    req.finished = true;
    this._requests.delete(req.id);
    req.push(item);
  }

  _failAll(err) {
    for (const req of [...this._requests.values()]) {
      const Cls = err.constructor;
      this._finish(req, {kind: "error", error: new Cls(err.code, err.detail, {retryable: err.retryable, id: req.id})});
    }
  }
}
