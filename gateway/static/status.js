/* Kaiten chat page: the status line (model, engines, running, waiting, KV use, or the stage of
 * engines still starting) from GET /v1/status.
 *
 * One poll chain: a poll started while another is in flight takes over the schedule, and an answer
 * older than the one shown is dropped, so a slow stale answer never overwrites a fresh one ("running
 * 1" after the reply had finished). refreshSoon() polls now and a few times more while the engines'
 * heartbeats catch up: app.js calls it when a reply starts or ends.
 *
 * It sends the page's API key (auth.js); a 401 opens the key prompt, and a new key polls again.
 *
 * window.KaitenStatus = { start(el, onStatus), poll(), refreshSoon() }; onStatus(answer) sees every
 * answer shown.
 */
(function () {
  "use strict";

  var EVERY_MS = 2000;
  var HIDDEN_EVERY_MS = 10000;
  var TIMEOUT_MS = 4000;
  var FOLLOW_UP_MS = [400, 1200, 2500];   // heartbeats come every second or so

  var el = null;
  var onStatus = null;
  var timer = null;
  var issued = 0;     // number of the latest poll started
  var shown = 0;      // number of the poll whose answer is on screen

  function poll() {
    clearTimeout(timer);
    var n = ++issued;
    var ctl = new AbortController();
    var t = setTimeout(function () { ctl.abort(); }, TIMEOUT_MS);
    var sentKey = window.KaitenAuth.key();
    fetch("/v1/status", { cache: "no-store", signal: ctl.signal, headers: window.KaitenAuth.headers() })
      .then(function (r) {
        if (r.status === 401 && sentKey === window.KaitenAuth.key()) window.KaitenAuth.required();   // not a replaced key
        if (!r.ok) throw new Error(r.status === 401 ? "API key needed" : "HTTP " + r.status);
        return r.json();
      })
      .then(function (s) { if (n > shown) { shown = n; render(s); } })
      .catch(function (e) {
        if (n < issued) return;
        el.textContent = e && e.message === "API key needed" ? "Status: API key needed" : "Status unavailable";
        el.setAttribute("data-ok", "false");
      })
      .then(function () {
        clearTimeout(t);
        if (n !== issued) return;   // a later poll owns the schedule
        timer = setTimeout(poll, document.visibilityState === "hidden" ? HIDDEN_EVERY_MS : EVERY_MS);
      });
  }

  function render(s) {
    if (onStatus) onStatus(s);
    el.setAttribute("data-ok", "true");
    el.setAttribute("data-running", String(s.num_requests_running | 0));
    el.setAttribute("data-waiting", String(s.num_requests_waiting | 0));
    var parts = [s.model || "model ?"];
    if (!s.engines && s.starting && s.starting.length) parts.push("starting: " + s.starting[0]);
    else if (!s.engines) parts.push("no engine");
    else {
      if (s.engines > 1) parts.push(s.engines + " engines");
      parts.push("running " + (s.num_requests_running | 0));
      parts.push("waiting " + (s.num_requests_waiting | 0));
      parts.push("KV " + Math.round(100 * (Number(s.kv_cache_usage) || 0)) + "%");
    }
    el.textContent = parts.join(" · ");
  }

  function refreshSoon() {
    poll();
    FOLLOW_UP_MS.forEach(function (ms) { setTimeout(poll, ms); });
  }

  function start(element, callback) {
    el = element;
    onStatus = callback || null;
    document.addEventListener("visibilitychange", function () {
      if (document.visibilityState === "visible") poll();
    });
    window.KaitenAuth.onChange(poll);
    poll();
  }

  window.KaitenStatus = { start: start, poll: poll, refreshSoon: refreshSoon };
})();
