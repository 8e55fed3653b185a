// The chat page: a thin UI over the JS client SDK (clients/js/llm-stream-client.js, served by
// the gateway at /clients/js/), which owns the socket, reconnects with backoff and resumes an
// answer from its last seq on any replica — so a dropped connection never shows here.
// Browsers cannot set headers on a WebSocket, so the SDK sends the API key (if any) in a first
// {type: "auth"} message rather than in the URL, where it would land in access logs.
import {StreamClient, Unauthorized} from "/clients/js/llm-stream-client.js";

const $ = (id) => document.getElementById(id);
const history = [];          // chat turns sent as `messages`
let client = null;
let clientKey = null;
let current = null;          // the Generation being shown

function setConn(state) {
  $("conn").textContent = state;
  $("conn").classList.toggle("on", state === "connected");
}

function setStatus(text) { $("status").textContent = text; }

function getClient() {
  const key = $("apikey").value.trim() || null;
  if (!client || key !== clientKey) {
    if (client) client.close();
    const proto = location.protocol === "https:" ? "wss:" : "ws:";
    client = new StreamClient(`${proto}//${location.host}/v1/stream`, {
      apiKey: key,
      onStatus: (state) => {
        setConn(state);
        if (current && state === "reconnecting") setStatus("resuming");
      },
    });
    clientKey = key;
    window.llmStream = client;   // for debugging (and the browser test): reconnects, connected
  }
  return client;
}

function bubble(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.textContent = text;
  $("log").appendChild(el);
  el.scrollIntoView({block: "end"});
  return el;
}

function meta(el, text) {
  const span = document.createElement("span");
  span.className = "meta";
  span.textContent = text;
  el.appendChild(span);
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
  $("ttft").textContent = "…";
  $("tokens").textContent = "0";
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("sending");
  const started = performance.now();
  let tokens = 0;
  const gen = getClient().generate({
    messages: history.slice(-20),
    max_tokens: parseInt($("maxtokens").value, 10) || 200,
    temperature: parseFloat($("temperature").value) || 0,
  });
  current = gen;
  try {
    for await (const chunk of gen) {
      if (tokens === 0) $("ttft").textContent = `${Math.round(performance.now() - started)} ms`;
      tokens += chunk.tokens;
      body.textContent = gen.text;
      $("tokens").textContent = tokens;
      setStatus("streaming");
      el.scrollIntoView({block: "end"});
    }
    const reason = gen.result.finishReason;
    meta(el, reason);
    history.push({role: "assistant", content: gen.text});
    finish(reason);
  } catch (err) {
    meta(el, `error: ${err.code} — ${err.detail || err.message}`);
    el.classList.add("error");
    if (gen.text) history.push({role: "assistant", content: gen.text});
    else history.pop();  // the user turn was not answered
    finish(`error: ${err.code || "failed"}`);
  }
}

function finish(status) {
  current = null;
  setStatus(status);
  $("send").disabled = false;
  $("stop").disabled = true;
}

function stop() {
  if (current) {
    current.cancel();
    setStatus("cancelling");
    $("stop").disabled = true;
  }
}

// Connect at once, so the badge says "connected" before the first message (the SDK would
// otherwise open the socket lazily, with the first generate); a changed API key reconnects.
function connectNow() {
  getClient().connect().catch((err) => setConn(err instanceof Unauthorized ? err.code : "disconnected"));
}

$("form").addEventListener("submit", send);
$("apikey").addEventListener("change", connectNow);
connectNow();
$("stop").addEventListener("click", stop);
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("form").requestSubmit(); }
});
