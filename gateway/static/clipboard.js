/* Kaiten chat page: copy text to the clipboard, with a note on the button that asked.
 *
 * navigator.clipboard needs a secure context (https or localhost); a server reached over plain http
 * on the LAN has none, so the fallback copies through a hidden textarea and execCommand("copy").
 *
 * window.KaitenClipboard = { copy(text) -> Promise, copyFrom(button, text) }.
 */
(function () {
  "use strict";

  var NOTE_MS = 1500;

  function legacyCopy(text) {
    var ta = document.createElement("textarea");
    ta.value = text;
    ta.setAttribute("readonly", "");
    ta.style.position = "fixed";
    ta.style.opacity = "0";
    document.body.appendChild(ta);
    ta.select();
    var ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    ta.remove();
    return ok;
  }

  function copy(text) {
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text).catch(function () {
        if (!legacyCopy(text)) throw new Error("copy failed");
      });
    }
    return legacyCopy(text) ? Promise.resolve() : Promise.reject(new Error("copy failed"));
  }

  // Copy, then say so on the button for a moment ("Copied" or "Copy failed").
  function copyFrom(button, text) {
    var label = button.getAttribute("data-label") || button.textContent;
    button.setAttribute("data-label", label);
    function note(result, words) {
      button.setAttribute("data-copied", result);
      button.textContent = words;
      setTimeout(function () { button.textContent = label; button.removeAttribute("data-copied"); }, NOTE_MS);
    }
    return copy(text).then(function () { note("true", "Copied"); }, function () { note("false", "Copy failed"); });
  }

  window.KaitenClipboard = { copy: copy, copyFrom: copyFrom };
})();
