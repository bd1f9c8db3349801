/* Kaiten chat page: the conversation, the socket and the controls. Plain JS, no build step.
 *
 * Talks to the gateway over /v1/chat/ws (its protocol: gateway/api/ws_chat.py): one socket, one
 * generation at a time from this page, the whole conversation sent on every turn.
 * Helpers loaded before this file: markdown.js (model text to sanitized DOM), chats.js (past chats
 * in localStorage), auth.js (the API key: socket subprotocols, HTTP headers, the key prompt),
 * status.js (the status line), clipboard.js (copy buttons).
 * User text goes into the DOM as text; model text only through KaitenMarkdown (DOMPurify).
 * A streaming reply is re-rendered at most once per animation frame, never per token.
 *
 * Test hooks: every message is an <article class="msg" data-role=... data-state=...> where the
 * assistant's data-state is queued | streaming | done | stopped | error, plus data-finish-reason,
 * data-prompt-tokens, data-completion-tokens once done. <body data-conn="open|connecting|closed|auth">
 * (auth: the server refused the key, 401; no reconnect until a key is entered).
 * window.kaitenChat exposes the socket and a few helpers (dropSocket, reconnectNow, snapshot).
 */
(function () {
  "use strict";

  var SETTINGS_KEY = "kaiten.settings.v1";
  // An empty sampling field is left out of the request: the server applies the model's default
  // (its generation_config.json), which the form shows as the placeholder (from /v1/status).
  var DEFAULTS = { model: "", system: "", temperature: "", top_p: "", max_tokens: "", seed: "" };
  var BACKOFF_MIN_MS = 500;
  var BACKOFF_MAX_MS = 8000;
  var PING_EVERY_MS = 15000;
  var PONG_TIMEOUT_MS = 6000;
  var CANCEL_GRACE_MS = 5000;

  function $(id) { return document.getElementById(id); }
  var els = {
    body: document.body,
    log: $("log"), empty: $("empty"), composer: $("composer"), prompt: $("prompt"),
    send: $("send"), stop: $("stop"), newChat: $("new-chat"),
    chatList: $("chat-list"), chatListEmpty: $("chat-list-empty"), chatsToggle: $("chats-toggle"),
    conn: $("conn"), connText: $("conn-text"), engineStatus: $("engine-status"),
    banner: $("conn-banner"), bannerText: $("conn-banner-text"), reconnectNow: $("reconnect-now"),
    settings: $("settings"), settingsToggle: $("settings-toggle"), resetSettings: $("reset-settings"),
    model: $("model"), system: $("system"), temperature: $("temperature"), top_p: $("top_p"),
    max_tokens: $("max_tokens"), seed: $("seed"), template: $("msg-template"),
  };

  // ------------------------------------------------------------------ ids
  var idCounter = 0;
  function newId() {
    idCounter += 1;
    return "c" + Date.now().toString(36) + idCounter.toString(36) + Math.random().toString(36).slice(2, 6);
  }

  // ------------------------------------------------------------------ storage
  function readJSON(key) {
    try { var raw = window.localStorage.getItem(key); return raw ? JSON.parse(raw) : null; }
    catch (e) { return null; }
  }
  function writeJSON(key, value) {
    try { window.localStorage.setItem(key, JSON.stringify(value)); } catch (e) { /* full or disabled */ }
  }

  var Chats = window.KaitenChats;
  Chats.migrateLegacy(newId);
  var chatId = Chats.current() || newId();
  var convo = loadConvo(chatId);
  var settings = loadSettings();
  var saveTimer = null;

  function loadConvo(id) {
    var c = Chats.load(id);
    if (!c) return { messages: [] };
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
    Chats.save(chatId, convo.messages.map(function (m) {
      var o = {};
      for (var k in m) if (Object.prototype.hasOwnProperty.call(m, k) && k.charAt(0) !== "_") o[k] = m[k];
      return o;
    }));
    renderChatList();
  }
  function saveSoon() { if (!saveTimer) saveTimer = setTimeout(saveNow, 400); }

  function loadSettings() {
    var s = readJSON(SETTINGS_KEY) || {};
    var out = {};
    for (var k in DEFAULTS) out[k] = (k in s) ? s[k] : DEFAULTS[k];
    return out;
  }
  function applySettingsToForm() {
    els.model.value = settings.model;
    if (els.model.value !== settings.model) addModelOption(settings.model);   // not listed (yet)
    els.system.value = settings.system;
    els.temperature.value = settings.temperature;
    els.top_p.value = settings.top_p;
    els.max_tokens.value = settings.max_tokens;
    els.seed.value = settings.seed;
  }
  function readSettingsFromForm() {
    settings = {
      model: els.model.value,
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
    if (settings.model) p.model = settings.model;
    var t = num(settings.temperature, 0, 2), tp = num(settings.top_p, 0.01, 1), mt = num(settings.max_tokens, 1, 1e6);
    if (t !== null) p.temperature = t;
    if (tp !== null) p.top_p = tp;
    if (mt !== null) p.max_tokens = Math.round(mt);
    var seed = String(settings.seed).trim();
    if (seed !== "" && isFinite(parseInt(seed, 10))) p.seed = parseInt(seed, 10);
    return p;
  }

  // ------------------------------------------------------------------ rendering
  var nodes = new Map();   // message id -> article element

  function nearBottom() {
    var l = els.log;
    return l.scrollHeight - l.scrollTop - l.clientHeight < 80;
  }
  function scrollToBottom() { els.log.scrollTop = els.log.scrollHeight; }

  // Streaming replies are drawn once per animation frame, however many deltas arrived since.
  var dirty = new Set();      // messages whose text changed since the last frame
  var frameAsked = false;
  var counters = { deltas: 0, markdownRenders: 0 };   // read by the tests (kaitenChat.counters)

  function renderSoon(m) {
    dirty.add(m);
    if (frameAsked) return;
    frameAsked = true;
    requestAnimationFrame(function () {
      frameAsked = false;
      var batch = Array.from(dirty);
      dirty.clear();
      batch.forEach(function (x) { if (nodes.has(x.id)) renderMessage(x); });
    });
  }

  function renderMarkdown(body, m) {
    counters.markdownRenders += 1;
    window.KaitenMarkdown.render(body, m.content || "", { final: m.state !== "streaming" });
  }

  function fmt(x, digits) { return (typeof x === "number" && isFinite(x)) ? x.toFixed(digits) : "–"; }
  var FINISH_LABEL = { stop: "stop", length: "length (max tokens)", cancelled: "cancelled" };

  function renderMessage(m) {
    dirty.delete(m);
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
      if (!m._editing) body.replaceChildren(document.createTextNode(m.content));
      el.setAttribute("data-state", m._editing ? "editing" : "done");
    } else {
      el.setAttribute("data-state", m.state);
      renderMarkdown(body, m);
      body.setAttribute("aria-busy", m.state === "streaming" || m.state === "queued" ? "true" : "false");
      renderNote(el, m);
      renderStats(el, m);
      renderError(el, m);
    }
    renderActions(el, m);
    if (fresh) {
      els.log.appendChild(el);
      els.empty.hidden = true;
    }
    if (stick) scrollToBottom();
    return el;
  }

  // Copy (any settled message), Edit (a user message), Regenerate (the last reply, once it ended).
  function renderActions(el, m) {
    var busy = !!activeReply();
    var settled = m.role === "user" || m.state === "done" || m.state === "stopped" || m.state === "error";
    var copy = el.querySelector(".act-copy");
    var edit = el.querySelector(".act-edit");
    var regen = el.querySelector(".act-regen");
    copy.hidden = !settled || !m.content || !!m._editing;
    edit.hidden = m.role !== "user" || !!m._editing;
    edit.disabled = busy;
    regen.hidden = m.role !== "assistant" || m !== convo.messages[convo.messages.length - 1] ||
      (m.state !== "done" && m.state !== "stopped");
    regen.disabled = busy;
    el.querySelector(".msg-actions").hidden = copy.hidden && edit.hidden && regen.hidden;
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
    if (e.code === "engines_starting") {
      text = "The engines are starting" + (e.retry_after != null ? "; try again in " + Math.ceil(e.retry_after) + " s." : ".");
    } else if (e.status === 429 || (e.status === 503 && e.code !== "engine_lost" && e.retry_after != null)) {
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
    convo.messages.forEach(function (m) { var el = nodes.get(m.id); if (el) renderActions(el, m); });
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
    var user = { id: newId(), role: "user", content: text };
    var reply = newReply();
    convo.messages.push(user, reply);
    els.prompt.value = "";
    autosize();
    renderMessage(user);
    enqueue(reply);
    saveNow();
    return true;
  }

  // A reply to send, with the settings in the form now.
  function newReply() {
    readSettingsFromForm();
    var params = requestParams();
    params.system = settings.system;
    return { id: newId(), role: "assistant", content: "", state: "queued", params: params };
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
      ["model", "temperature", "top_p", "max_tokens", "seed"].forEach(function (k) { if (p[k] != null) frame[k] = p[k]; });
      if (!sendFrame(frame)) break;
      outbox.shift();
      m.state = "streaming";
      m._sentAt = performance.now();
      m._firstAt = null;
      m._cancelRequested = false;
      renderMessage(m);
      saveSoon();
      window.KaitenStatus.refreshSoon();
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
    window.KaitenStatus.refreshSoon();
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

  // Answer the last question again: the last reply is replaced by a new one.
  function regenerate() {
    var last = convo.messages[convo.messages.length - 1];
    if (!last || last.role !== "assistant" || activeReply()) return;
    dropNode(last.id);
    convo.messages.pop();
    var reply = newReply();
    convo.messages.push(reply);
    enqueue(reply);
    saveNow();
  }

  function dropNode(id) {
    var el = nodes.get(id);
    if (el) el.remove();
    nodes.delete(id);
  }

  // Edit a question in place: Enter (or Send) drops everything after it and asks again.
  function startEdit(m) {
    var el = nodes.get(m.id);
    if (!el || activeReply()) return;
    m._editing = true;
    var form = document.createElement("form");
    form.className = "msg-edit";
    var ta = document.createElement("textarea");
    ta.value = m.content;
    ta.rows = Math.min(12, m.content.split("\n").length + 1);
    ta.setAttribute("aria-label", "Edit your message");
    var send = button("Send", "btn btn-primary btn-small edit-send", "submit");
    var cancel = button("Cancel", "btn btn-small edit-cancel", "button");
    var row = document.createElement("div");
    row.className = "msg-edit-buttons";
    row.append(cancel, send);
    form.append(ta, row);
    form.addEventListener("submit", function (ev) { ev.preventDefault(); editAndResend(m, ta.value); });
    cancel.addEventListener("click", function () { endEdit(m); });
    ta.addEventListener("keydown", function (ev) {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229) { ev.preventDefault(); editAndResend(m, ta.value); }
      else if (ev.key === "Escape") { ev.stopPropagation(); endEdit(m); }
    });
    el.querySelector(".msg-body").replaceChildren(form);
    renderMessage(m);
    ta.focus();
    ta.setSelectionRange(ta.value.length, ta.value.length);
  }
  function endEdit(m) {
    m._editing = false;
    renderMessage(m);
    var el = nodes.get(m.id);
    if (el) el.querySelector(".act-edit").focus();
  }
  function button(text, cls, type) {
    var b = document.createElement("button");
    b.type = type;
    b.className = cls;
    b.textContent = text;
    return b;
  }

  function editAndResend(m, text) {
    var i = convo.messages.indexOf(m);
    if (!text.trim() || i < 0 || activeReply()) return;
    m._editing = false;
    m.content = text;
    convo.messages.slice(i + 1).forEach(function (x) { dropNode(x.id); });
    convo.messages = convo.messages.slice(0, i + 1);
    renderMessage(m);
    var reply = newReply();
    convo.messages.push(reply);
    enqueue(reply);
    saveNow();
  }

  // ------------------------------------------------------------------ past chats
  function renderChatList() {
    var frag = document.createDocumentFragment();
    Chats.list().forEach(function (c) {
      var li = document.createElement("li");
      li.className = "chat-item";
      li.setAttribute("data-chat-id", c.id);
      var open = button(c.title, "chat-open", "button");
      open.title = c.title;
      if (c.id === chatId) open.setAttribute("aria-current", "true");
      var del = button("×", "chat-delete", "button");
      del.title = "Delete chat";
      del.setAttribute("aria-label", "Delete chat: " + c.title);
      li.append(open, del);
      frag.appendChild(li);
    });
    els.chatList.replaceChildren(frag);
    els.chatListEmpty.hidden = els.chatList.children.length > 0;
  }

  // Leave the open chat: a reply still in progress stops there (the server is told to cancel it).
  function leaveChat() {
    var changed = !!saveTimer;
    byId.forEach(function (m) {
      if (m.state === "streaming" && wsOpen) sendFrame({ type: "cancel", id: m.id });
      m.state = "stopped";
      m.finish_reason = "cancelled";
      changed = true;
    });
    outbox.length = 0;
    byId.clear();
    if (changed) saveNow();
  }

  function showChat(id) {
    chatId = id;
    Chats.setCurrent(id);
    convo = loadConvo(id);
    resumeQueued();
    renderAll();
    renderChatList();
    closeChats();
    if (wsOpen) flushOutbox();
  }

  // Replies saved while offline ("queued") are sent when the socket is open.
  function resumeQueued() {
    convo.messages.forEach(function (m) {
      if (m.role === "assistant" && m.state === "queued") { byId.set(m.id, m); outbox.push(m.id); }
    });
  }

  function openChat(id) {
    if (id === chatId) { closeChats(); return; }
    leaveChat();
    showChat(id);
  }

  function newChat() {
    leaveChat();
    showChat(newId());
    els.prompt.focus();
  }

  function deleteChat(id) {
    var c = Chats.list().find(function (x) { return x.id === id; });
    if (!c || !window.confirm("Delete the chat \u201c" + c.title + "\u201d?")) return;
    if (id !== chatId) { Chats.remove(id); renderChatList(); return; }
    leaveChat();
    Chats.remove(id);
    var next = Chats.list()[0];
    showChat(next ? next.id : newId());
  }

  // ------------------------------------------------------------------ frames from the server
  function onFrame(f) {
    if (!f || typeof f !== "object") return;
    if (f.type === "pong") return;
    var m = f.id != null ? byId.get(f.id) : null;
    if (f.type === "error" && !m && f.status === 401) { window.KaitenAuth.required(); return; }
    if (f.type === "error" && !m) { showNotice(f); return; }
    if (!m) return;   // a generation this page no longer tracks (new chat, stopped locally)
    switch (f.type) {
      case "start":
        m.request_id = f.request_id;
        if (f.model) m.model = f.model;
        break;
      case "delta":
        if (typeof f.content === "string" && f.content) {
          counters.deltas += 1;
          if (m._firstAt == null) m._firstAt = performance.now();
          m.content += f.content;
          if (m.state !== "streaming") m.state = "streaming";
          renderSoon(m);
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
        window.KaitenStatus.refreshSoon();
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
        window.KaitenStatus.refreshSoon();
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
  var authRefused = false;   // the server answered 401: wait for a key instead of reconnecting

  function wsUrl() {
    var proto = location.protocol === "https:" ? "wss:" : "ws:";
    return proto + "//" + location.host + "/v1/chat/ws";
  }

  function connect() {
    if (ws || unloading) return;
    clearTimeout(reconnectTimer); reconnectTimer = null;
    setConn("connecting");
    var sock;
    try { sock = new WebSocket(wsUrl(), window.KaitenAuth.protocols()); } catch (e) { ws = null; onSocketClosed("could not open a socket"); return; }
    ws = sock;
    // The server accepts every handshake and then refuses a bad key with a 401 frame, so the socket
    // is "open" only once a first ping is answered: a refused socket never gets that far.
    sock.onopen = function () {
      if (ws !== sock) return;
      try { sock.send(JSON.stringify({ type: "ping" })); } catch (e) { onSocketClosed("could not send"); return; }
      awaitPong();
    };
    sock.onmessage = function (ev) {
      if (ws !== sock) return;
      clearTimeout(pongTimer); pongTimer = null;
      var f;
      try { f = JSON.parse(ev.data); } catch (e) { return; }
      if (!wsOpen && f && f.type === "pong") { onConfirmed(); return; }
      onFrame(f);
    };
    sock.onerror = function () { /* onclose follows */ };
    sock.onclose = function (ev) {
      if (ws !== sock) return;
      onSocketClosed(ev && ev.code ? "closed (" + ev.code + ")" : "closed");
    };
  }

  // A ping was sent: the socket is given up unless some frame arrives within PONG_TIMEOUT_MS.
  function awaitPong() {
    pongTimer = setTimeout(function () { pongTimer = null; onSocketClosed("no answer to ping"); }, PONG_TIMEOUT_MS);
  }

  function onConfirmed() {
    wsOpen = true;
    attempt = 0;
    setConn("open");
    flushOutbox();
    // Queued notes say "Sending…" now.
    convo.messages.forEach(function (m) { if (m.state === "queued") renderMessage(m); });
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
    if (unloading) return;
    if (authRefused) setConn("auth");
    else scheduleReconnect();
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
    } else if (state === "auth") {
      els.connText.textContent = "API key needed";
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
    if (sendFrame({ type: "ping" })) awaitPong();
  }, PING_EVERY_MS);

  // Another tab changed the chats: list them again, and follow the open chat unless this tab is in
  // the middle of a reply.
  window.addEventListener("storage", function (ev) {
    if (ev.key === Chats.INDEX_KEY) renderChatList();
    if (!Chats.isChatKey(ev.key, chatId) || byId.size || outbox.length) return;
    convo = loadConvo(chatId);
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
    if (document.visibilityState === "visible" && !ws) reconnectSoon();
  });

  // The model picker: every model and adapter in /v1/status (a chosen one the server no longer
  // lists stays, so the choice survives a restart of its engines), and the chosen one's defaults.
  function addModelOption(name) {
    if (!name) return;
    var o = document.createElement("option");
    o.value = name;
    o.textContent = name;
    els.model.appendChild(o);
    els.model.value = name;
  }
  function showModels(s) {
    var models = Array.isArray(s.models) ? s.models : [];
    var names = [];
    models.forEach(function (m) {
      names.push(m.model);
      (m.adapters || []).forEach(function (a) { names.push(a); });
    });
    var have = Array.prototype.map.call(els.model.options, function (o) { return o.value; }).slice(1);
    if (names.join("\n") !== have.join("\n")) {
      var chosen = els.model.value;
      while (els.model.options.length > 1) els.model.remove(1);
      names.forEach(function (n) { var o = document.createElement("option"); o.value = n; o.textContent = n; els.model.appendChild(o); });
      els.model.value = chosen;
      if (els.model.value !== chosen) addModelOption(chosen);
    }
    els.model.options[0].textContent = "the server's default" + (s.model ? " (" + s.model + ")" : "");
    var base = models.find(function (m) { return m.model === settings.model || (m.adapters || []).indexOf(settings.model) >= 0; });
    showServerDefaults(base ? base.generation_defaults : s.generation_defaults);
  }

  // The sampling fields' placeholders: the model's defaults, which an empty field leaves to the server.
  function showServerDefaults(d) {
    if (!d) return;
    els.temperature.placeholder = "model default " + d.temperature;
    els.top_p.placeholder = "model default " + d.top_p;
    els.max_tokens.placeholder = d.max_tokens != null ? "model default " + d.max_tokens : "up to the context";
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
  els.log.addEventListener("click", function (ev) {
    var btn = ev.target.closest("button");
    if (!btn) return;
    if (btn.classList.contains("code-copy")) {
      window.KaitenClipboard.copyFrom(btn, btn.closest(".code-block").querySelector("pre code").textContent);
      return;
    }
    var art = btn.closest("article.msg");
    var m = art && convo.messages.find(function (x) { return x.id === art.getAttribute("data-id"); });
    if (!m) return;
    if (btn.classList.contains("act-copy")) window.KaitenClipboard.copyFrom(btn, m.content);
    else if (btn.classList.contains("act-edit")) startEdit(m);
    else if (btn.classList.contains("act-regen")) regenerate();
  });
  els.chatList.addEventListener("click", function (ev) {
    var btn = ev.target.closest("button");
    var li = btn && btn.closest("li[data-chat-id]");
    if (!li) return;
    var id = li.getAttribute("data-chat-id");
    if (btn.classList.contains("chat-delete")) deleteChat(id);
    else openChat(id);
  });
  els.chatsToggle.addEventListener("click", function () {
    var open = !els.body.classList.contains("chats-open");
    els.body.classList.toggle("chats-open", open);
    els.chatsToggle.setAttribute("aria-expanded", open ? "true" : "false");
    if (open) { var cur = els.chatList.querySelector("[aria-current]") || els.chatList.querySelector("button"); if (cur) cur.focus(); }
  });
  function closeChats() {
    if (!els.body.classList.contains("chats-open")) return;
    els.body.classList.remove("chats-open");
    els.chatsToggle.setAttribute("aria-expanded", "false");
  }
  els.reconnectNow.addEventListener("click", reconnectSoon);
  // A new key: a refused or closed socket connects with it now (an open one keeps its session).
  window.KaitenAuth.onChange(function () {
    authRefused = false;
    if (!wsOpen) { if (ws) onSocketClosed("new API key"); reconnectSoon(); }
  });
  // The key was refused (by this socket or by status.js's poll, with the same key): wait for a new
  // one; a socket the server has not answered yet is refused too, so it is dropped now.
  window.KaitenAuth.onRefused(function () {
    authRefused = true;
    if (wsOpen) return;
    clearTimeout(reconnectTimer); reconnectTimer = null;
    if (ws) onSocketClosed("API key refused");
    else setConn("auth");
  });
  $("api-key-open").addEventListener("click", function () { closeSettings(); window.KaitenAuth.open(); });
  ["model", "system", "temperature", "top_p", "max_tokens", "seed"].forEach(function (k) {
    els[k].addEventListener("change", readSettingsFromForm);
  });
  els.model.addEventListener("change", function () { window.KaitenStatus.poll(); });
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
  $("chats-close").addEventListener("click", function () { closeChats(); els.chatsToggle.focus(); });
  document.addEventListener("keydown", function (ev) { if (ev.key === "Escape") { closeSettings(); closeChats(); } });

  // ------------------------------------------------------------------ test hook
  window.kaitenChat = {
    get socket() { return ws; },
    get connected() { return wsOpen; },
    get outbox() { return outbox.slice(); },
    dropSocket: function () { if (ws) ws.close(4000, "test: drop"); },
    reconnectNow: reconnectSoon,
    snapshot: function () { return JSON.parse(JSON.stringify(convo)); },
    get chatId() { return chatId; },
    counters: counters,
    render: function (el, text) { window.KaitenMarkdown.render(el, text); },
    pollStatus: function () { window.KaitenStatus.poll(); },
    historyFor: function (id) { var m = convo.messages.find(function (x) { return x.id === id; }); return m ? historyBefore(m) : null; },
  };

  // ------------------------------------------------------------------ start
  applySettingsToForm();
  Chats.setCurrent(chatId);
  resumeQueued();
  renderAll();
  renderChatList();
  autosize();
  connect();
  window.KaitenStatus.start(els.engineStatus, showModels);
  els.prompt.focus();
})();
