/* Kaiten chat page: model text (markdown) to safe DOM.
 *
 * marked (GFM: lists, emphasis, links, tables, fenced code) builds the HTML; raw HTML in the model's
 * text is shown as text, never as markup; images become links (nothing loads behind the user's back);
 * DOMPurify sanitizes the result (javascript: links, event handlers); highlight.js colours code.
 * Each fenced block gets a header with its language and a Copy button (.code-copy; app.js handles
 * the click). Libraries: vendor/ (see vendor/README.md).
 *
 * window.KaitenMarkdown.render(container, text, {final}) replaces the container's children. While a
 * reply streams (final false) code without a language is not auto-detected: that is the costly part.
 */
(function () {
  "use strict";

  var HIGHLIGHT_CACHE_MAX = 200;
  var highlightCache = new Map();   // lang + "\0" + code -> highlighted HTML (closed blocks recur per frame)
  var purify = window.DOMPurify(window);   // an instance of our own: its hook stays ours
  var SANITIZE = { RETURN_DOM_FRAGMENT: true, FORBID_TAGS: ["style", "form"], FORBID_ATTR: ["style"] };

  purify.addHook("afterSanitizeAttributes", function (node) {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });

  function escapeHtml(s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }
  function langOf(info) {
    var word = String(info || "").trim().split(/\s+/)[0] || "";
    return word.replace(/[^\w+#.-]/g, "").slice(0, 32);
  }

  var md = new window.marked.Marked({ gfm: true, breaks: true });
  md.use({
    renderer: {
      html: function (t) {
        var text = escapeHtml(t.text.replace(/\n+$/, ""));
        return t.block ? '<p class="md-html">' + text + "</p>" : text;
      },
      code: function (t) {
        var lang = langOf(t.lang);
        var attr = lang ? ' data-lang="' + escapeHtml(lang) + '"' : "";
        return '<pre class="md-code"' + attr + "><code>" + escapeHtml(t.text) + "</code></pre>";
      },
      codespan: function (t) { return '<code class="md-inline">' + escapeHtml(t.text) + "</code>"; },
      image: function (t) {
        var href = t.href || "";
        return '<a href="' + escapeHtml(href) + '">' + escapeHtml(t.text || t.title || href) + "</a>";
      },
    },
  });

  function highlighted(code, lang, final) {
    var hljs = window.hljs;
    if (!hljs) return null;
    if (lang && !hljs.getLanguage(lang)) return null;
    if (!lang && !final) return null;
    var key = lang + "\0" + code;
    var html = highlightCache.get(key);
    if (html == null) {
      html = lang ? hljs.highlight(code, { language: lang, ignoreIllegals: true }).value
                  : hljs.highlightAuto(code).value;
      if (highlightCache.size >= HIGHLIGHT_CACHE_MAX) highlightCache.clear();
      highlightCache.set(key, html);
    }
    return html;
  }

  function decorateCode(pre, final) {
    var code = pre.querySelector("code");
    var lang = pre.getAttribute("data-lang") || "";
    var html = code && highlighted(code.textContent, lang, final);
    if (html != null) {
      code.replaceChildren(purify.sanitize(html, SANITIZE));
      code.classList.add("hljs");
      if (lang) code.classList.add("language-" + lang);
    }
    var block = document.createElement("div");
    block.className = "code-block";
    var head = document.createElement("div");
    head.className = "code-head";
    var name = document.createElement("span");
    name.className = "code-lang";
    name.textContent = lang || "code";
    var copy = document.createElement("button");
    copy.type = "button";
    copy.className = "btn-act code-copy";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy code");
    head.append(name, copy);
    pre.replaceWith(block);
    block.append(head, pre);
  }

  function render(container, text, opts) {
    var final = !opts || opts.final !== false;
    var frag = purify.sanitize(md.parse(String(text || "")), SANITIZE);
    frag.querySelectorAll("pre.md-code").forEach(function (pre) { decorateCode(pre, final); });
    container.replaceChildren(frag);
  }

  window.KaitenMarkdown = { render: render };
})();
