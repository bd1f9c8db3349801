/* Kaiten chat page: plain JS, no build step, no dependencies.
 *
 * Talks to the gateway over /v1/chat/ws (see .helpers/WS_PROTOCOL.md): one socket, one
 * generation at a time from this page, the whole conversation sent on every turn.
 * Model text is only ever put into the DOM with textContent / text nodes, never innerHTML.
 *
 * Test hooks: every message is an <article class="msg" data-role=... data-state=...> where the
 * assistant's data-state is queued | streaming | done | stopped | error, plus data-finish-reason,
 * data-prompt-tokens, data-completion-tokens once done. <body data-conn="open|connecting|closed">.
 * window.kaitenChat exposes the socket and a few helpers (dropSocket, reconnectNow, snapshot).
 */
(function () {
  "use strict";

  var STORE_KEY = "kaiten.chat.v1";
  var SETTINGS_KEY = "kaiten.settings.v1";
  // An empty sampling field is left out of the request: the server applies the model's default
  // (its generation_config.json), which the form shows as the placeholder (from /v1/status).
  var DEFAULTS = { system: "", temperature: "", top_p: "", max_tokens: "", seed: "" };
  var BACKOFF_MIN_MS = 500;
  var BACKOFF_MAX_MS = 8000;
  var STATUS_EVERY_MS = 2000;
  var STATUS_HIDDEN_EVERY_MS = 10000;
  var PING_EVERY_MS = 15000;
  var PONG_TIMEOUT_MS = 6000;
  var CANCEL_GRACE_MS = 5000;

  function $(id) { return document.getElementById(id); }
  var els = {
    body: document.body,
    log: $("log"), empty: $("empty"), composer: $("composer"), prompt: $("prompt"),
    send: $("send"), stop: $("stop"), newChat: $("new-chat"),
    conn: $("conn"), connText: $("conn-text"), engineStatus: $("engine-status"),
    banner: $("conn-banner"), bannerText: $("conn-banner-text"), reconnectNow: $("reconnect-now"),
    settings: $("settings"), settingsToggle: $("settings-toggle"), resetSettings: $("reset-settings"),
    system: $("system"), temperature: $("temperature"), top_p: $("top_p"),
    max_tokens: $("max_tokens"), seed: $("seed"), template: $("msg-template"),
  };

  // ------------------------------------------------------------------ storage
  function readJSON(key) {
    try { var raw = window.localStorage.getItem(key); return raw ? JSON.parse(raw) : null; }
    catch (e) { return null; }
  }
  function writeJSON(key, value) {
    try { window.localStorage.setItem(key, JSON.stringify(value)); } catch (e) { /* full or disabled */ }
  }

  var convo = loadConvo();
  var settings = loadSettings();
  var saveTimer = null;

  function loadConvo() {
    var c = readJSON(STORE_KEY);
    if (!c || !Array.isArray(c.messages)) return { messages: [] };
    c.messages = c.messages.filter(function (m) { return m && (m.role === "user" || m.role === "assistant"); });
    // "streaming" in a fresh save is another open tab's reply in progress: shown, left alone.
    // In a stale save it is a reply whose page went away without saying so (the server aborted it).
    var stale = !c.savedAt || Date.now() - c.savedAt > 20000;
    c.messages.forEach(function (m) {
      if (!m.id) m.id = newId();
      if (m.role === "assistant" && m.state === "streaming" && stale) interrupt(m);
    });
    return { messages: c.messages };
  }
  // The socket is going away under this reply: keep what was shown, or send it again if nothing was.
  function interrupt(m) {
    if (m.content) {
      m.state = "error";
      m.error = { code: "interrupted", message: "Interrupted: the page was closed while this reply was streaming." };
    } else {
      m.state = "queued";
    }
  }
  function saveNow() {
    if (saveTimer) { clearTimeout(saveTimer); saveTimer = null; }
    writeJSON(STORE_KEY, { savedAt: Date.now(), messages: convo.messages.map(function (m) {
      var o = {};
      for (var k in m) if (Object.prototype.hasOwnProperty.call(m, k) && k.charAt(0) !== "_") o[k] = m[k];
      return o;
    }) });
  }
  function saveSoon() { if (!saveTimer) saveTimer = setTimeout(saveNow, 400); }

  function loadSettings() {
    var s = readJSON(SETTINGS_KEY) || {};
    var out = {};
    for (var k in DEFAULTS) out[k] = (k in s) ? s[k] : DEFAULTS[k];
    return out;
  }
  function applySettingsToForm() {
    els.system.value = settings.system;
    els.temperature.value = settings.temperature;
    els.top_p.value = settings.top_p;
    els.max_tokens.value = settings.max_tokens;
    els.seed.value = settings.seed;
  }
  function readSettingsFromForm() {
    settings = {
      system: els.system.value,
      temperature: els.temperature.value,
      top_p: els.top_p.value,
      max_tokens: els.max_tokens.value,
      seed: els.seed.value,
    };
    writeJSON(SETTINGS_KEY, settings);
  }
  function num(v, lo, hi) {
    var x = parseFloat(v);
    return isFinite(x) ? Math.min(hi, Math.max(lo, x)) : null;
  }
  function requestParams() {
    var p = {};
    var t = num(settings.temperature, 0, 2), tp = num(settings.top_p, 0.01, 1), mt = num(settings.max_tokens, 1, 1e6);
    if (t !== null) p.temperature = t;
    if (tp !== null) p.top_p = tp;
    if (mt !== null) p.max_tokens = Math.round(mt);
    var seed = String(settings.seed).trim();
    if (seed !== "" && isFinite(parseInt(seed, 10))) p.seed = parseInt(seed, 10);
    return p;
  }

  // ------------------------------------------------------------------ ids
  var idCounter = 0;
  function newId() {
    idCounter += 1;
    return "c" + Date.now().toString(36) + idCounter.toString(36) + Math.random().toString(36).slice(2, 6);
  }

  // ------------------------------------------------------------------ rendering
  var nodes = new Map();   // message id -> article element

  function nearBottom() {
    var l = els.log;
    return l.scrollHeight - l.scrollTop - l.clientHeight < 80;
  }
  function scrollToBottom() { els.log.scrollTop = els.log.scrollHeight; }

  // Markdown-ish: ``` fences become <pre><code> (whitespace kept), `inline` becomes <code>;
  // everything else is text in a pre-wrap block. Built from text nodes only.
  var FENCE_OPEN = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)[^`]*$/;
  function renderRich(container, text) {
    var frag = document.createDocumentFragment();
    var lines = text.split("\n");
    var textBuf = [];
    var code = null;         // {fence, lang, lines}
    function flushText() {
      if (!textBuf.length) return;
      var t = textBuf.join("\n").replace(/^\n+|\n+$/g, "");
      textBuf = [];
      if (!t) return;
      var div = document.createElement("div");
      div.className = "md-text";
      appendInline(div, t);
      frag.appendChild(div);
    }
    function flushCode(open) {
      var pre = document.createElement("pre");
      pre.className = "md-code" + (open ? " md-code-open" : "");
      var c = document.createElement("code");
      if (code.lang) { c.className = "language-" + code.lang.replace(/[^\w+#.-]/g, ""); pre.setAttribute("data-lang", code.lang); }
      c.textContent = code.lines.join("\n");
      pre.appendChild(c);
      frag.appendChild(pre);
      code = null;
    }
    for (var i = 0; i < lines.length; i++) {
      var line = lines[i];
      if (code) {
        var trimmed = line.replace(/^ {0,3}/, "").replace(/[ \t]+$/, "");
        if (trimmed.length >= code.fence.length && trimmed === code.fence.charAt(0).repeat(trimmed.length)) {
          flushCode(false);
        } else {
          code.lines.push(line);
        }
        continue;
      }
      var m = FENCE_OPEN.exec(line);
      if (m) {
        flushText();
        code = { fence: m[1], lang: m[2] || "", lines: [] };
      } else {
        textBuf.push(line);
      }
    }
    flushText();
    if (code) flushCode(true);   // still streaming (or never closed): show what we have
    container.replaceChildren(frag);
  }
  function appendInline(el, text) {
    var parts = text.split(/(`[^`\n]+`)/);
    for (var i = 0; i < parts.length; i++) {
      var p = parts[i];
      if (!p) continue;
      if (p.length > 2 && p.charAt(0) === "`" && p.charAt(p.length - 1) === "`") {
        var c = document.createElement("code");
        c.className = "md-inline";
        c.textContent = p.slice(1, -1);
        el.appendChild(c);
      } else {
        el.appendChild(document.createTextNode(p));
      }
    }
  }

  function fmt(x, digits) { return (typeof x === "number" && isFinite(x)) ? x.toFixed(digits) : "–"; }
  var FINISH_LABEL = { stop: "stop", length: "length (max tokens)", cancelled: "cancelled" };

  function renderMessage(m) {
    var el = nodes.get(m.id);
    var fresh = !el;
    if (fresh) {
      el = els.template.content.firstElementChild.cloneNode(true);
      el.setAttribute("data-id", m.id);
      el.setAttribute("data-role", m.role);
      el.classList.add(m.role === "user" ? "msg-user" : "msg-assistant");
      el.querySelector(".msg-role").textContent = m.role === "user" ? "You" : "Assistant";
      el.querySelector(".msg-retry").addEventListener("click", function () { retry(m.id); });
      nodes.set(m.id, el);
    }
    var stick = fresh || nearBottom();
    var body = el.querySelector(".msg-body");
    if (m.role === "user") {
      body.replaceChildren(document.createTextNode(m.content));
      el.setAttribute("data-state", "done");
    } else {
      renderRich(body, m.content || "");
      el.setAttribute("data-state", m.state);
      body.setAttribute("aria-busy", m.state === "streaming" || m.state === "queued" ? "true" : "false");
      renderNote(el, m);
      renderStats(el, m);
      renderError(el, m);
    }
    if (fresh) {
      els.log.appendChild(el);
      els.empty.hidden = true;
    }
    if (stick) scrollToBottom();
    return el;
  }

  function renderNote(el, m) {
    var note = el.querySelector(".msg-note");
    var text = "";
    var cls = "msg-note";
    if (m.state === "queued") { text = wsOpen ? "Sending…" : "Waiting for the connection; this message will be sent when it is back."; cls += " note-queued"; }
    else if (m.state === "streaming" && !m.content) { text = m._cancelRequested ? "Stopping…" : "Thinking…"; cls += " note-typing"; }
    else if (m.state === "stopped") { text = m.content ? "Stopped" : "Stopped before any text"; cls += " note-stopped"; }
    else if (m.state === "done" && !m.content) { text = "(empty reply)"; }
    note.className = cls;
    note.textContent = text;
    note.hidden = !text;
  }

  function renderStats(el, m) {
    var box = el.querySelector(".msg-stats");
    if (m.finish_reason) el.setAttribute("data-finish-reason", m.finish_reason);
    else el.removeAttribute("data-finish-reason");
    if (!m.usage || (m.state !== "done" && m.state !== "stopped")) { box.hidden = true; box.replaceChildren(); return; }
    el.setAttribute("data-prompt-tokens", String(m.usage.prompt_tokens));
    el.setAttribute("data-completion-tokens", String(m.usage.completion_tokens));
    var met = m.metrics || {};
    var items = [
      ["ttft", "Time to first token", "TTFT " + fmt(met.ttft_s, 2) + " s"],
      ["tps", "Tokens per second", fmt(met.tokens_per_second, 1) + " tok/s"],
      ["tokens", "Completion tokens (prompt " + m.usage.prompt_tokens + ")", m.usage.completion_tokens + " tokens"],
      ["finish", "Finish reason", FINISH_LABEL[m.finish_reason] || String(m.finish_reason)],
    ];
    var frag = document.createDocumentFragment();
    items.forEach(function (it, i) {
      if (i) { var sep = document.createElement("span"); sep.className = "sep"; sep.setAttribute("aria-hidden", "true"); sep.textContent = "·"; frag.appendChild(sep); }
      var s = document.createElement("span");
      s.setAttribute("data-stat", it[0]);
      s.title = it[1];
      s.textContent = it[2];
      frag.appendChild(s);
    });
    box.replaceChildren(frag);
    box.hidden = false;
  }

  function renderError(el, m) {
    var box = el.querySelector(".msg-error");
    if (m.state !== "error" || !m.error) { box.hidden = true; return; }
    var e = m.error;
    var text;
    if (e.status === 429 || (e.status === 503 && e.code !== "engine_lost" && e.retry_after != null)) {
      text = "The server is busy (" + e.status + ")" + (e.retry_after != null ? "; try again in " + Math.ceil(e.retry_after) + " s." : ".");
    } else if (e.code === "engine_lost") {
      text = "The engine serving this reply was lost (503). The reply ends here.";
    } else if (e.code === "stream_gap") {
      text = "Part of the reply went missing on the way (stream gap); it ends here.";
    } else if (e.code === "connection_lost") {
      text = "The connection dropped during the reply; it ends here.";
    } else if (e.code === "interrupted") {
      text = e.message;
    } else {
      text = (e.status ? "Error " + e.status + ": " : "Error: ") + (e.message || "unknown error");
    }
    if (e.message && (e.code === "engine_lost" || e.code === "stream_gap" || e.status === 429 || e.status === 503) && text.indexOf(e.message) < 0) {
      text += " (" + e.message + ")";
    }
    box.setAttribute("data-code", e.code || "");
    if (e.status) box.setAttribute("data-status", String(e.status)); else box.removeAttribute("data-status");
    box.querySelector(".msg-error-text").textContent = text;
    var btn = box.querySelector(".msg-retry");
    var last = convo.messages[convo.messages.length - 1];
    btn.hidden = !(last && last.id === m.id);
    updateRetryCountdown(btn, m);
    box.hidden = false;
  }

  function updateRetryCountdown(btn, m) {
    var until = m.error && m.error._retryAt;
    var left = until ? Math.ceil((until - Date.now()) / 1000) : 0;
    if (left > 0) {
      btn.disabled = true;
      btn.textContent = "Retry in " + left + " s";
      setTimeout(function () { if (nodes.get(m.id)) renderMessage(m); }, 1000);
    } else {
      btn.disabled = false;
      btn.textContent = "Retry";
    }
  }

  function renderAll() {
    nodes.forEach(function (el) { el.remove(); });
    nodes.clear();
    convo.messages.forEach(renderMessage);
    els.empty.hidden = convo.messages.length > 0;
    updateControls();
    scrollToBottom();
  }

  function activeReply() {
    for (var i = convo.messages.length - 1; i >= 0; i--) {
      var m = convo.messages[i];
      if (m.role === "assistant" && (m.state === "streaming" || m.state === "queued") && byId.has(m.id)) return m;
    }
    return null;
  }
  function updateControls() {
    var busy = !!activeReply();
    els.send.hidden = busy;
    els.stop.hidden = !busy;
    els.send.disabled = busy;
    els.body.setAttribute("data-busy", busy ? "true" : "false");
  }

  // ------------------------------------------------------------------ conversation
  var byId = new Map();   // client request id -> assistant message (those sent or queued)
  var outbox = [];        // assistant message ids waiting for an open socket

  function historyBefore(m) {
    var out = [];
    var sys = String(m.params && m.params.system != null ? m.params.system : settings.system).trim();
    if (sys) out.push({ role: "system", content: sys });
    for (var i = 0; i < convo.messages.length; i++) {
      var x = convo.messages[i];
      if (x.id === m.id) break;
      if (x.role === "user") out.push({ role: "user", content: x.content });
      else if (x.role === "assistant" && x.content) {   // done, stopped or cut short: what the user saw
        out.push({ role: "assistant", content: x.content });
      }
    }
    return out;
  }

  function submit() {
    var text = els.prompt.value;
    if (!text.trim() || activeReply()) return false;
    readSettingsFromForm();
    var user = { id: newId(), role: "user", content: text };
    var params = requestParams();
    params.system = settings.system;
    var reply = { id: newId(), role: "assistant", content: "", state: "queued", params: params };
    convo.messages.push(user, reply);
    els.prompt.value = "";
    autosize();
    renderMessage(user);
    enqueue(reply);
    saveNow();
    return true;
  }

  function enqueue(m) {
    m.state = "queued";
    byId.set(m.id, m);
    if (outbox.indexOf(m.id) < 0) outbox.push(m.id);
    renderMessage(m);
    updateControls();
    if (wsOpen) flushOutbox();
    else if (!ws) reconnectSoon();   // waiting on backoff: try now, the user is here
  }

  function flushOutbox() {
    while (wsOpen && outbox.length) {
      var m = byId.get(outbox[0]);
      if (!m || m.state !== "queued") { outbox.shift(); continue; }
      var p = m.params || requestParams();
      var frame = { type: "chat", id: m.id, messages: historyBefore(m) };
      ["temperature", "top_p", "max_tokens", "seed"].forEach(function (k) { if (p[k] != null) frame[k] = p[k]; });
      if (!sendFrame(frame)) break;
      outbox.shift();
      m.state = "streaming";
      m._sentAt = performance.now();
      m._firstAt = null;
      m._cancelRequested = false;
      renderMessage(m);
      saveSoon();
    }
    updateControls();
  }

  function stop() {
    var m = activeReply();
    if (!m) return;
    if (m.state === "queued") {
      var i = outbox.indexOf(m.id);
      if (i >= 0) outbox.splice(i, 1);
      finishStopped(m);
      return;
    }
    m._cancelRequested = true;
    if (!(wsOpen && sendFrame({ type: "cancel", id: m.id }))) { finishStopped(m); return; }
    renderMessage(m);
    // The server answers with done/cancelled; if it never does, end the reply here anyway.
    setTimeout(function () { if (m.state === "streaming") finishStopped(m); }, CANCEL_GRACE_MS);
  }

  function finishStopped(m) {
    m.state = "stopped";
    m.finish_reason = "cancelled";
    byId.delete(m.id);
    renderMessage(m);
    updateControls();
    saveNow();
  }

  function retry(id) {
    var m = convo.messages.find(function (x) { return x.id === id; });
    if (!m || activeReply()) return;
    m.content = "";
    m.error = null; m.usage = null; m.metrics = null; m.finish_reason = null;
    readSettingsFromForm();
    m.params = requestParams();
    m.params.system = settings.system;
    enqueue(m);
    saveNow();
  }

  function newChat() {
    var m = activeReply();
    if (m && m.state === "streaming" && wsOpen) sendFrame({ type: "cancel", id: m.id });
    outbox.length = 0;
    byId.clear();
    convo = { messages: [] };
    saveNow();
    renderAll();
    els.prompt.focus();
  }

  // ------------------------------------------------------------------ frames from the server
  function onFrame(f) {
    if (!f || typeof f !== "object") return;
    if (f.type === "pong") return;
    var m = f.id != null ? byId.get(f.id) : null;
    if (f.type === "error" && !m) { showNotice(f); return; }
    if (!m) return;   // a generation this page no longer tracks (new chat, stopped locally)
    switch (f.type) {
      case "start":
        m.request_id = f.request_id;
        if (f.model) m.model = f.model;
        break;
      case "delta":
        if (typeof f.content === "string" && f.content) {
          if (m._firstAt == null) m._firstAt = performance.now();
          m.content += f.content;
          if (m.state !== "streaming") m.state = "streaming";
          renderMessage(m);
          saveSoon();
        }
        break;
      case "done":
        m.finish_reason = f.finish_reason || "stop";
        m.usage = f.usage || { prompt_tokens: 0, completion_tokens: 0, total_tokens: 0 };
        m.metrics = f.metrics || {};
        var now = performance.now();
        if (m.metrics.ttft_s == null && m._firstAt != null && m._sentAt != null) m.metrics.ttft_s = (m._firstAt - m._sentAt) / 1000;
        if (m.metrics.tokens_per_second == null && m._firstAt != null && now > m._firstAt) {
          m.metrics.tokens_per_second = m.usage.completion_tokens / ((now - m._firstAt) / 1000);
        }
        m.state = m.finish_reason === "cancelled" ? "stopped" : "done";
        byId.delete(m.id);
        renderMessage(m);
        updateControls();
        saveNow();
        break;
      case "error":
        var err = f.error || {};
        m.state = "error";
        m.error = { status: f.status, code: err.code || err.type || null, message: err.message || "",
                    retry_after: f.retry_after != null ? f.retry_after : err.retry_after };
        if (m.error.retry_after != null) m.error._retryAt = Date.now() + 1000 * Number(m.error.retry_after);
        byId.delete(m.id);
        renderMessage(m);
        updateControls();
        saveNow();
        break;
    }
  }

  // Errors that belong to no generation (a malformed frame, the socket refused): a transient line.
  function showNotice(f) {
    var err = f.error || {};
    var p = document.createElement("p");
    p.className = "notice";
    p.setAttribute("role", "alert");
    p.textContent = "Server error" + (f.status ? " " + f.status : "") + ": " + (err.message || "unknown") +
      (f.retry_after != null ? " (retry after " + f.retry_after + " s)" : "");
    els.log.appendChild(p);
    scrollToBottom();
    setTimeout(function () { p.remove(); }, 15000);
  }

  // ------------------------------------------------------------------ the socket
  var ws = null;
  var wsOpen = false;
  var attempt = 0;
  var reconnectTimer = null;
  var reconnectAt = 0;
  var pongTimer = null;
  var countdownTimer = null;
  var unloading = false;

  function wsUrl() {
    var proto = location.protocol === "https:" ? "wss:" : "ws:";
    return proto + "//" + location.host + "/v1/chat/ws";
  }

  function connect() {
    if (ws || unloading) return;
    clearTimeout(reconnectTimer); reconnectTimer = null;
    setConn("connecting");
    var sock;
    try { sock = new WebSocket(wsUrl()); } catch (e) { ws = null; onSocketClosed("could not open a socket"); return; }
    ws = sock;
    sock.onopen = function () {
      if (ws !== sock) return;
      wsOpen = true;
      attempt = 0;
      setConn("open");
      flushOutbox();
      // Queued notes say "Sending…" now.
      convo.messages.forEach(function (m) { if (m.state === "queued") renderMessage(m); });
    };
    sock.onmessage = function (ev) {
      if (ws !== sock) return;
      clearTimeout(pongTimer); pongTimer = null;
      var f;
      try { f = JSON.parse(ev.data); } catch (e) { return; }
      onFrame(f);
    };
    sock.onerror = function () { /* onclose follows */ };
    sock.onclose = function (ev) {
      if (ws !== sock) return;
      onSocketClosed(ev && ev.code ? "closed (" + ev.code + ")" : "closed");
    };
  }

  // Forget the socket and recover every generation it carried (the server aborts them).
  function onSocketClosed(reason) {
    var sock = ws;
    ws = null;
    wsOpen = false;
    clearTimeout(pongTimer); pongTimer = null;
    if (sock) { sock.onopen = sock.onmessage = sock.onclose = sock.onerror = null; try { sock.close(); } catch (e) { /* already */ } }
    var requeue = [];
    convo.messages.forEach(function (m) {
      if (m.role !== "assistant" || m.state !== "streaming") return;
      if (m._cancelRequested) { finishStopped(m); return; }
      if (!m.content) { requeue.push(m.id); m.state = "queued"; }   // nothing shown yet: send again
      else {
        m.state = "error";
        m.error = { code: "connection_lost", message: reason };
        byId.delete(m.id);
      }
      renderMessage(m);
    });
    outbox = requeue.concat(outbox.filter(function (id) { return requeue.indexOf(id) < 0; }));
    updateControls();
    saveNow();
    if (!unloading) scheduleReconnect();
  }

  function scheduleReconnect() {
    clearTimeout(reconnectTimer);
    var base = Math.min(BACKOFF_MAX_MS, BACKOFF_MIN_MS * Math.pow(2, attempt));
    var delay = Math.round(base * (0.8 + 0.4 * Math.random()));
    attempt += 1;
    reconnectAt = Date.now() + delay;
    reconnectTimer = setTimeout(connect, delay);
    setConn("closed");
  }
  function reconnectSoon() {
    if (ws) return;
    attempt = 0;
    connect();
  }

  function sendFrame(obj) {
    if (!ws || !wsOpen || ws.readyState !== WebSocket.OPEN) return false;
    try { ws.send(JSON.stringify(obj)); return true; } catch (e) { return false; }
  }

  function setConn(state) {
    els.body.setAttribute("data-conn", state);
    els.conn.setAttribute("data-conn", state);
    clearInterval(countdownTimer); countdownTimer = null;
    if (state === "open") {
      els.connText.textContent = "Connected";
      els.banner.hidden = true;
    } else if (state === "connecting") {
      els.connText.textContent = attempt ? "Reconnecting…" : "Connecting…";
      if (attempt) { els.bannerText.textContent = "Reconnecting…"; }
    } else {
      els.connText.textContent = "Offline";
      els.banner.hidden = false;
      var tick = function () {
        var left = Math.max(0, Math.ceil((reconnectAt - Date.now()) / 1000));
        var queued = outbox.length ? " Your message is queued and will be sent on reconnect." : "";
        els.bannerText.textContent = "Connection lost. Reconnecting in " + left + " s (attempt " + attempt + ")." + queued;
      };
      tick();
      countdownTimer = setInterval(tick, 500);
    }
  }

  setInterval(function () {
    if (!wsOpen || pongTimer) return;
    if (sendFrame({ type: "ping" })) {
      pongTimer = setTimeout(function () { pongTimer = null; onSocketClosed("no answer to ping"); }, PONG_TIMEOUT_MS);
    }
  }, PING_EVERY_MS);

  // Another tab changed the conversation: follow it unless this one is in the middle of a reply.
  window.addEventListener("storage", function (ev) {
    if (ev.key !== STORE_KEY || byId.size || outbox.length) return;
    var c = readJSON(STORE_KEY);
    if (!c || !Array.isArray(c.messages)) return;
    convo = { messages: c.messages.filter(function (m) { return m && m.id && (m.role === "user" || m.role === "assistant"); }) };
    renderAll();
  });
  window.addEventListener("online", reconnectSoon);
  window.addEventListener("pagehide", function () {
    unloading = true;
    byId.forEach(function (m) { if (m.state === "streaming") interrupt(m); });
    saveNow();
  });
  window.addEventListener("pageshow", function (ev) { if (ev.persisted) { unloading = false; reconnectSoon(); } });
  document.addEventListener("visibilitychange", function () {
    if (document.visibilityState === "visible") { if (!ws) reconnectSoon(); pollStatus(); }
  });

  // ------------------------------------------------------------------ status line
  var statusTimer = null;
  function pollStatus() {
    clearTimeout(statusTimer);
    var ctl = "AbortController" in window ? new AbortController() : null;
    var t = setTimeout(function () { if (ctl) ctl.abort(); }, 4000);
    fetch("/v1/status", { cache: "no-store", signal: ctl ? ctl.signal : undefined })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(renderStatus)
      .catch(function () {
        els.engineStatus.textContent = "Status unavailable";
        els.engineStatus.setAttribute("data-ok", "false");
      })
      .then(function () {
        clearTimeout(t);
        statusTimer = setTimeout(pollStatus, document.visibilityState === "hidden" ? STATUS_HIDDEN_EVERY_MS : STATUS_EVERY_MS);
      });
  }
  function showServerDefaults(d) {
    if (!d) return;
    els.temperature.placeholder = "model default " + d.temperature;
    els.top_p.placeholder = "model default " + d.top_p;
    els.max_tokens.placeholder = d.max_tokens != null ? "model default " + d.max_tokens : "up to the context";
  }
  function renderStatus(s) {
    showServerDefaults(s.generation_defaults);
    var e = els.engineStatus;
    e.setAttribute("data-ok", "true");
    e.setAttribute("data-running", String(s.num_requests_running));
    e.setAttribute("data-waiting", String(s.num_requests_waiting));
    var parts = [s.model || "model ?"];
    if (!s.engines) parts.push("no engine");
    else {
      if (s.engines > 1) parts.push(s.engines + " engines");
      parts.push("running " + (s.num_requests_running | 0));
      parts.push("waiting " + (s.num_requests_waiting | 0));
      parts.push("KV " + Math.round(100 * (Number(s.kv_cache_usage) || 0)) + "%");
    }
    e.textContent = parts.join(" · ");
  }

  // ------------------------------------------------------------------ composer and controls
  function autosize() {
    var t = els.prompt;
    t.style.height = "auto";
    t.style.height = Math.min(t.scrollHeight + 2, Math.round(window.innerHeight * 0.4)) + "px";
  }
  els.prompt.addEventListener("input", autosize);
  els.prompt.addEventListener("keydown", function (ev) {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229) {
      ev.preventDefault();
      submit();
    }
  });
  els.composer.addEventListener("submit", function (ev) { ev.preventDefault(); submit(); els.prompt.focus(); });
  els.stop.addEventListener("click", function () { stop(); els.prompt.focus(); });
  els.newChat.addEventListener("click", newChat);
  els.reconnectNow.addEventListener("click", reconnectSoon);
  ["system", "temperature", "top_p", "max_tokens", "seed"].forEach(function (k) {
    els[k].addEventListener("change", readSettingsFromForm);
  });
  els.resetSettings.addEventListener("click", function () {
    settings = Object.assign({}, DEFAULTS);
    writeJSON(SETTINGS_KEY, settings);
    applySettingsToForm();
  });
  els.settingsToggle.addEventListener("click", function () {
    var open = !els.body.classList.contains("settings-open");
    els.body.classList.toggle("settings-open", open);
    els.settingsToggle.setAttribute("aria-expanded", open ? "true" : "false");
    if (open) els.system.focus();
  });
  function closeSettings() {
    if (!els.body.classList.contains("settings-open")) return;
    els.body.classList.remove("settings-open");
    els.settingsToggle.setAttribute("aria-expanded", "false");
    readSettingsFromForm();
    els.settingsToggle.focus();
  }
  $("settings-close").addEventListener("click", closeSettings);
  document.addEventListener("keydown", function (ev) { if (ev.key === "Escape") closeSettings(); });

  // ------------------------------------------------------------------ test hook
  window.kaitenChat = {
    get socket() { return ws; },
    get connected() { return wsOpen; },
    get outbox() { return outbox.slice(); },
    dropSocket: function () { if (ws) ws.close(4000, "test: drop"); },
    reconnectNow: reconnectSoon,
    snapshot: function () { return JSON.parse(JSON.stringify(convo)); },
    render: function (el, text) { renderRich(el, text); },
    historyFor: function (id) { var m = convo.messages.find(function (x) { return x.id === id; }); return m ? historyBefore(m) : null; },
  };

  // ------------------------------------------------------------------ start
  applySettingsToForm();
  convo.messages.forEach(function (m) {
    if (m.role === "assistant" && m.state === "queued") { byId.set(m.id, m); outbox.push(m.id); }
  });
  renderAll();
  autosize();
  connect();
  pollStatus();
  els.prompt.focus();
})();
