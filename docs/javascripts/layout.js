// kvguard docs: layout helpers (mkdocs.yml: extra_javascript). Presentation only.
(function () {
  // Where a long identifier in a table may break: after . : / ( [ , (never inside a word
  // such as KVGUARD_TARGETS).
  var BREAK_AFTER = /([.:/(\[,])(?=[^\s)\]])/g;

  function breakPoints(code) {
    if (code.textContent.length < 20 || code.children.length) return;
    var parts = code.textContent.split(BREAK_AFTER);
    if (parts.length < 2) return;
    code.textContent = "";
    for (var i = 0; i < parts.length; i++) {
      if (!parts[i]) continue;
      code.appendChild(document.createTextNode(parts[i]));
      if (i % 2 === 1) code.appendChild(document.createElement("wbr"));
    }
  }

  // A bash block's lines each in a block span, so that a wrapped command's continuation is
  // indented (extra.css).
  function lineSpans(code) {
    if (code.querySelector(".kv-line")) return;
    var lines = [[]];
    Array.prototype.slice.call(code.childNodes).forEach(function (node) {
      if (node.nodeType === 3 && node.data.indexOf("\n") >= 0) {
        var pieces = node.data.split("\n");
        pieces.forEach(function (piece, j) {
          if (j > 0) lines.push([]);
          if (piece) lines[lines.length - 1].push(document.createTextNode(piece));
        });
      } else {
        lines[lines.length - 1].push(node);
      }
    });
    if (lines.length && lines[lines.length - 1].length === 0) lines.pop();
    code.textContent = "";
    lines.forEach(function (nodes) {
      var span = document.createElement("span");
      span.className = "kv-line";
      nodes.forEach(function (n) { span.appendChild(n); });
      if (!nodes.length) span.appendChild(document.createTextNode("\u200b"));
      code.appendChild(span);
    });
  }

  function run() {
    document.querySelectorAll(".md-typeset table:not([class]) code, .md-typeset .doc-md-description code")
      .forEach(breakPoints);
    document.querySelectorAll(".md-typeset .language-bash pre > code").forEach(lineSpans);
  }

  if (typeof document$ !== "undefined") document$.subscribe(run);
  else if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", run);
  else run();
})();
