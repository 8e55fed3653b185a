// Browser client for /v1/stream (JSON subprotocol). No build step, no dependencies.
// Browsers cannot set headers on a WebSocket, so the API key (if any) goes in a first
// {type: "auth"} message rather than in the URL, where it would land in access logs.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];          // chat turns sent as `messages`
let ws = null;
let current = null;          // {id, requestId, lastSeq, el, text, started, tokens}
let counter = 0;

function setConn(on) {
  $("conn").textContent = on ? "connected" : "disconnected";
  $("conn").classList.toggle("on", on);
}

function setStatus(text) { $("status").textContent = text; }

function connect() {
  if (ws && (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING)) {
    return Promise.resolve(ws);
  }
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return new Promise((resolve, reject) => {
    const sock = new WebSocket(`${proto}//${location.host}/v1/stream`, ["llm-stream.json"]);
    sock.onopen = () => {
      const key = $("apikey").value.trim();
      if (key) sock.send(JSON.stringify({type: "auth", api_key: key}));
      setConn(true);
      resolve(sock);
    };
    sock.onerror = () => reject(new Error("connection failed"));
    sock.onmessage = (ev) => onMessage(JSON.parse(ev.data));
    sock.onclose = (ev) => {
      setConn(false);
      if (ws === sock) ws = null;
      // a dropped stream is resumed on a fresh socket (any replica) from the last seq seen
      if (current && ev.code !== 1008) setTimeout(resume, 500);
    };
    ws = sock;
  });
}

async function resume() {
  if (!current) return;
  try {
    const sock = await connect();
    setStatus("resuming");
    sock.send(JSON.stringify({type: "resume", id: current.id, last_seq: current.lastSeq,
                              request_id: current.requestId || undefined}));
  } catch (e) {
    setTimeout(resume, 1000);
  }
}

function bubble(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.textContent = text;
  $("log").appendChild(el);
  el.scrollIntoView({block: "end"});
  return el;
}

function onMessage(msg) {
  if (msg.type === "heartbeat" || msg.type === "pong") return;
  if (msg.type === "error" && (!current || (msg.id && msg.id !== current.id))) {
    setStatus(`error: ${msg.code}`);
    return;
  }
  if (!current || msg.id !== current.id) return;
  if (msg.type === "accepted") {
    current.requestId = msg.request_id;
    setStatus("streaming");
  } else if (msg.type === "chunk") {
    if (current.tokens === 0) {
      $("ttft").textContent = `${Math.round(performance.now() - current.started)} ms`;
    }
    current.text += msg.text;
    current.tokens += msg.tokens;
    current.lastSeq = msg.seq;
    current.body.textContent = current.text;
    $("tokens").textContent = current.tokens;
    current.el.scrollIntoView({block: "end"});
  } else if (msg.type === "done") {
    const reason = msg.finish_reason;
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = reason === "error" ? `error: ${msg.error.code} — ${msg.error.message}` : reason;
    current.el.appendChild(meta);
    if (reason === "error") current.el.classList.add("error");
    history.push({role: "assistant", content: current.text});
    finish(reason);
  } else if (msg.type === "error") {
    current.body.textContent = current.text || "";
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = `error: ${msg.code} — ${msg.message}`;
    current.el.appendChild(meta);
    current.el.classList.add("error");
    history.pop();  // the user turn was not answered
    finish(`error: ${msg.code}`);
  }
}

function finish(status) {
  current = null;
  setStatus(status);
  $("send").disabled = false;
  $("stop").disabled = true;
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || current) return;
  bubble("user", text);
  history.push({role: "user", content: text});
  $("prompt").value = "";
  const el = bubble("assistant", "");
  const body = document.createElement("span");
  el.appendChild(body);
  current = {id: `b${Date.now().toString(36)}-${++counter}`, requestId: null, lastSeq: 0, el, body,
             text: "", tokens: 0, started: performance.now()};
  $("ttft").textContent = "…";
  $("tokens").textContent = "0";
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("sending");
  try {
    const sock = await connect();
    sock.send(JSON.stringify({
      type: "generate", id: current.id, messages: history.slice(-20),
      max_tokens: parseInt($("maxtokens").value, 10) || 200,
      temperature: parseFloat($("temperature").value) || 0,
    }));
  } catch (e) {
    body.textContent = "could not connect";
    history.pop();
    finish("disconnected");
  }
}

function stop() {
  if (current && ws && ws.readyState === WebSocket.OPEN) {
    ws.send(JSON.stringify({type: "cancel", id: current.id}));
    setStatus("cancelling");
    $("stop").disabled = true;
  }
}

$("form").addEventListener("submit", send);
$("stop").addEventListener("click", stop);
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
