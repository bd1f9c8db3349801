/* Kaiten chat page: past chats in localStorage.
 *
 * An index (kaiten.chats.v2: [{id, title, updatedAt}]) lists the chats; each chat's messages live
 * under their own key (kaiten.chat.v2.<id>: {savedAt, messages}), so saving the open chat while it
 * streams rewrites only that chat. kaiten.chats.current names the open one. A chat with no messages
 * is not stored. The single conversation of earlier versions (kaiten.chat.v1) becomes the first chat.
 *
 * window.KaitenChats: list, load, save, remove, current, setCurrent, isChatKey, INDEX_KEY.
 */
(function () {
  "use strict";

  var INDEX_KEY = "kaiten.chats.v2";
  var CHAT_PREFIX = "kaiten.chat.v2.";
  var CURRENT_KEY = "kaiten.chats.current";
  var LEGACY_KEY = "kaiten.chat.v1";
  var TITLE_CHARS = 60;

  function readJSON(key) {
    try { var raw = window.localStorage.getItem(key); return raw ? JSON.parse(raw) : null; }
    catch (e) { return null; }
  }
  function writeJSON(key, value) {
    try { window.localStorage.setItem(key, JSON.stringify(value)); return true; }
    catch (e) { return false; }   // full or disabled
  }
  function removeKey(key) {
    try { window.localStorage.removeItem(key); } catch (e) { /* disabled */ }
  }

  function list() {
    var index = readJSON(INDEX_KEY);
    if (!Array.isArray(index)) return [];
    return index.filter(function (c) { return c && typeof c.id === "string"; })
      .sort(function (a, b) { return (b.updatedAt || 0) - (a.updatedAt || 0); });
  }

  function titleOf(messages) {
    var first = messages.find(function (m) { return m.role === "user" && String(m.content).trim(); });
    var t = first ? String(first.content).replace(/\s+/g, " ").trim() : "New chat";
    return t.length > TITLE_CHARS ? t.slice(0, TITLE_CHARS - 1) + "…" : t;
  }

  function load(id) {
    var c = readJSON(CHAT_PREFIX + id);
    return c && Array.isArray(c.messages) ? c : null;
  }

  // Store the chat's messages and list it first; an empty chat is removed instead. savedAt (now
  // unless given) tells a reply still streaming in another tab from one whose page went away.
  function save(id, messages, savedAt) {
    if (!messages.length) { remove(id); return; }
    var now = Date.now();
    writeJSON(CHAT_PREFIX + id, { savedAt: savedAt || now, messages: messages });
    var index = list().filter(function (c) { return c.id !== id; });
    index.unshift({ id: id, title: titleOf(messages), updatedAt: now });
    writeJSON(INDEX_KEY, index);
  }

  function remove(id) {
    removeKey(CHAT_PREFIX + id);
    var index = list();
    var kept = index.filter(function (c) { return c.id !== id; });
    if (kept.length !== index.length) writeJSON(INDEX_KEY, kept);
  }

  function current() {
    try { return window.localStorage.getItem(CURRENT_KEY); } catch (e) { return null; }
  }
  function setCurrent(id) {
    try { window.localStorage.setItem(CURRENT_KEY, id); } catch (e) { /* disabled */ }
  }

  function isChatKey(key, id) { return key === CHAT_PREFIX + id; }

  function migrateLegacy(newId) {
    var old = readJSON(LEGACY_KEY);
    if (old && Array.isArray(old.messages) && old.messages.length && !list().length) {
      var id = newId();
      save(id, old.messages, old.savedAt || 1);
      setCurrent(id);
    }
    if (old) removeKey(LEGACY_KEY);
  }

  window.KaitenChats = {
    INDEX_KEY: INDEX_KEY, list: list, load: load, save: save, remove: remove,
    current: current, setCurrent: setCurrent, isChatKey: isChatKey, migrateLegacy: migrateLegacy,
  };
})();
