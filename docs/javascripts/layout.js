// kvguard docs: layout helpers (mkdocs.yml: extra_javascript). Presentation only.
(function () {
  // Inline code is split only where a reader expects it: at spaces, and in a long word
  // (a module:qualname, a path) after . : / ( [ , = (and after the _ of a lower-case
  // name inside a piece still over 24 characters). A word such as KVGUARD_TARGETS,
  // --report-dir or allow=() stays on one line: each piece between break points is a
  // nowrap span (extra.css), with a <wbr> after it. The text itself is unchanged.
  var BREAK_AFTER = /([.:/(\[,=])(?=[^\s)\]])/;
  var LONG = 24;

  function keepWords(code) {
    if (code.children.length || !/[^\w\s]/.test(code.textContent)) return;
    var words = code.textContent.split(/(\s+)/);
    code.textContent = "";
    words.forEach(function (word) {
      if (!word) return;
      if (/^\s+$/.test(word) || /^\w+$/.test(word)) {
        code.appendChild(document.createTextNode(word));
        return;
      }
      var pieces = word.length > LONG ? word.split(new RegExp(BREAK_AFTER.source, "g")) : [word];
      // split() with a capture group alternates piece, separator, piece, ...
      var joined = [];
      for (var i = 0; i < pieces.length; i += 2) {
        var piece = pieces[i] + (pieces[i + 1] || "");
        // a piece still longer than that (compute_rollout_correction_and_add_to_batch) may
        // break after an underscore between lower-case words too (never KVGUARD_TARGETS),
        // so that a table keeps to the page's width
        if (piece.length > LONG) joined.push.apply(joined, piece.split(/(?<=[a-z0-9]_)(?=[a-z])/));
        else joined.push(piece);
      }
      joined.forEach(function (piece, j) {
        if (!piece) return;
        var span = document.createElement("span");
        span.className = "kv-nowrap";
        span.textContent = piece;
        code.appendChild(span);
        if (j < joined.length - 1) code.appendChild(document.createElement("wbr"));
      });
    });
  }

  // A bash block's lines each in a block span, so that a wrapped command's continuation is
  // indented (extra.css). Each span keeps its newline: the block's text, which the copy
  // button copies, is unchanged.
  function lineSpans(code) {
    if (code.querySelector(".kv-line")) return;
    var lines = [[]];
    Array.prototype.slice.call(code.childNodes).forEach(function (node) {
      if (node.nodeType === 3 && node.data.indexOf("\n") >= 0) {
        node.data.split("\n").forEach(function (piece, j, all) {
          if (piece) lines[lines.length - 1].push(document.createTextNode(piece));
          if (j < all.length - 1) {
            lines[lines.length - 1].push(document.createTextNode("\n"));
            lines.push([]);
          }
        });
      } else {
        lines[lines.length - 1].push(node);
      }
    });
    code.textContent = "";
    lines.forEach(function (nodes) {
      if (!nodes.length) return;
      var span = document.createElement("span");
      span.className = "kv-line";
      nodes.forEach(function (n) { span.appendChild(n); });
      code.appendChild(span);
    });
  }

  function run() {
    document.querySelectorAll(".md-typeset :not(pre) > code").forEach(keepWords);
    document.querySelectorAll(".md-typeset .language-bash pre > code").forEach(lineSpans);
  }

  if (typeof document$ !== "undefined") document$.subscribe(run);
  else if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", run);
  else run();
})();
