/* Kaiten chat page: the API key of a server started with --api-key.
 *
 * HTTP fetches send it as "Authorization: Bearer <key>". A browser cannot set that header on a
 * WebSocket, so the socket offers the subprotocols "kaiten.v1" and "kaiten.bearer.<base64url of the
 * key>" (base64url: any key is a legal subprotocol token); the server answers "kaiten.v1". The key
 * never goes into a URL.
 *
 * Storage: sessionStorage by default (this tab only, gone when it closes: a key is a credential),
 * localStorage when "Remember in this browser" is ticked (for one's own machine).
 *
 * A 401 (from status.js or the socket) calls required(): every onRefused callback (app.js drops a
 * socket not yet answered, which the server refuses too) and the key form opens with a prompt.
 * Saving a key calls every onChange callback (app.js reconnects, status.js polls).
 *
 * window.KaitenAuth = { key(), headers(), protocols(), required(), open(), onChange(cb), onRefused(cb) }
 */
(function () {
  "use strict";

  var STORE_KEY = "kaiten.apiKey";
  var WS_PROTOCOL = "kaiten.v1";
  var BEARER_PREFIX = "kaiten.bearer.";
  var listeners = [];
  var refusedListeners = [];

  function $(id) { return document.getElementById(id); }
  var els = {
    form: $("auth"), text: $("auth-text"), input: $("api-key"), remember: $("api-key-remember"),
    forget: $("api-key-forget"), cancel: $("api-key-cancel"),
  };

  function read(store) { try { return window[store].getItem(STORE_KEY) || ""; } catch (e) { return ""; } }
  function drop(store) { try { window[store].removeItem(STORE_KEY); } catch (e) { /* disabled */ } }
  function key() { return read("sessionStorage") || read("localStorage"); }

  function save(value, remember) {
    drop("sessionStorage");
    drop("localStorage");
    if (!value) return;
    try { window[remember ? "localStorage" : "sessionStorage"].setItem(STORE_KEY, value); } catch (e) { /* disabled */ }
  }

  function base64url(text) {
    var bin = "";
    new TextEncoder().encode(text).forEach(function (b) { bin += String.fromCharCode(b); });
    return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function headers(extra) {
    var h = Object.assign({}, extra || {});
    var k = key();
    if (k) h.Authorization = "Bearer " + k;
    return h;
  }

  function protocols() {
    var k = key();
    return k ? [WS_PROTOCOL, BEARER_PREFIX + base64url(k)] : [];
  }

  function show(text, alert) {
    els.text.textContent = text;
    els.text.setAttribute("role", alert ? "alert" : "status");
    els.form.setAttribute("data-reason", alert ? "refused" : "asked");
    els.input.value = "";
    els.remember.checked = !!read("localStorage");
    els.forget.hidden = !key();
    els.form.hidden = false;
    document.body.setAttribute("data-auth", alert ? "needed" : "editing");
    els.input.focus();
  }

  function required() {
    refusedListeners.forEach(function (cb) { cb(); });
    if (!els.form.hidden && els.form.getAttribute("data-reason") === "refused") return;
    show(key() ? "The server did not accept this API key (401). Enter the key it was started with."
               : "This server needs an API key (it was started with --api-key). Enter it to chat.", true);
  }

  function open() { show(key() ? "Enter a new API key, or forget the one in use." : "API key for this server.", false); }

  function close(changed) {
    els.form.hidden = true;
    document.body.setAttribute("data-auth", key() ? "key" : "none");
    if (changed) listeners.forEach(function (cb) { cb(); });
  }

  els.form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    var value = els.input.value.trim();
    if (!value) { els.input.focus(); return; }
    save(value, els.remember.checked);
    close(true);
  });
  els.forget.addEventListener("click", function () { save("", false); close(true); });
  els.cancel.addEventListener("click", function () { close(false); });
  document.body.setAttribute("data-auth", key() ? "key" : "none");

  window.KaitenAuth = {
    key: key, headers: headers, protocols: protocols, required: required, open: open,
    onChange: function (cb) { listeners.push(cb); },
    onRefused: function (cb) { refusedListeners.push(cb); },
  };
})();
