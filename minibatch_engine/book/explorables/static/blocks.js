// Chapter 4: the physical pool of KV blocks and each request's block table,
// step by step; shared blocks (after a fork), copies on write, and the memory
// a reserved cache would hold for the same tokens.
// data: {variants: [{label, requests, block_size, num_blocks, max_model_len,
//   steps: [{tables: {req index: [block ids]}, filled: {block: tokens}, cow}]}], step}
(function () {
  var MBE = window.MBE;
  var PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#8172b2", "#da8bc3", "#937860", "#64b5cd", "#ccb974"];
  // a shared block: a mid-tone between the text and the page, so its label (in the
  // text colour, with a halo of the page colour) reads in light and dark mode
  var SHARED = "color-mix(in srgb, var(--mbe-fg) 45%, var(--mbe-bg))";
  var HALO = ";paint-order:stroke;stroke:var(--mbe-bg);stroke-width:3px;stroke-linejoin:round";
  MBE.blockCounts = function (s) {
    var refs = {}, blocks = 0, tokens = 0, shared = 0;
    for (var r in s.tables) s.tables[r].forEach(function (b) { refs[b] = (refs[b] || 0) + 1; });
    for (var b in refs) {
      blocks++;
      tokens += s.filled[b] || 0;
      if (refs[b] > 1) shared++;
    }
    return { refs: refs, blocks: blocks, tokens: tokens, shared: shared, requests: Object.keys(s.tables).length };
  };
  MBE.kinds.blocks = function (root, d) {
    var box = MBE.el("div", { "class": "mbe-controls" }, root);
    var view = MBE.el("div", { "class": "mbe-view" }, root);
    var outs = MBE.el("div", { "class": "mbe-outs" }, view);
    var o = {
      blocks: MBE.out(outs, "blocks", "blocks held:"),
      tokens: MBE.out(outs, "tokens", "tokens in them:"),
      shared: MBE.out(outs, "shared", "shared blocks:"),
      cow: MBE.out(outs, "cow", "copies on write so far:"),
      peak: MBE.out(outs, "peak", "peak blocks so far:"),
    };
    var status = MBE.el("p", { "class": "mbe-note" }, view);
    var panels = MBE.el("div", { "class": "mbe-panels" }, view);
    var left = MBE.el("div", { "class": "mbe-panel" }, panels);
    MBE.el("div", { "class": "mbe-title" }, left, "Physical pool (block id; fill)");
    var pool = MBE.svg("svg", { role: "img", "aria-label": "the physical pool of KV blocks" }, left);
    var right = MBE.el("div", { "class": "mbe-panel" }, panels);
    MBE.el("div", { "class": "mbe-title" }, right, "Block tables (logical block -> physical)");
    var tables = MBE.el("table", {}, right);
    var mem = MBE.el("div", {}, view);
    MBE.el("div", { "class": "mbe-title" }, mem, "The same tokens, paged and reserved");
    var memTable = MBE.el("table", {}, mem);
    var variant = null, step = null;
    var show = function () {
      var v = d.variants[variant ? Number(variant.value) : 0];
      var n = v.steps.length;
      step.max = n - 1;
      if (Number(step.value) > n - 1) step.value = n - 1;
      step.mbeUpdateLabel();
      var t = Number(step.value), s = v.steps[t], c = MBE.blockCounts(s);
      var cow = 0, peak = 0;
      for (var k = 0; k <= t; k++) { cow += v.steps[k].cow; peak = Math.max(peak, MBE.blockCounts(v.steps[k]).blocks); }
      o.blocks(c.blocks, c.blocks + " of " + v.num_blocks);
      o.tokens(c.tokens, String(c.tokens));
      o.shared(c.shared, String(c.shared));
      o.cow(cow, String(cow));
      o.peak(peak, String(peak));
      status.textContent = "Step " + t + " of " + n + (s.cow ? ": " + s.cow + " block(s) copied on write" : "") + ".";
      // the pool: one square per block, coloured by owner, filled to its tokens
      var owner = {};
      for (var r in s.tables) s.tables[r].forEach(function (b) { owner[b] = owner[b] === undefined ? Number(r) : -1; });
      var cols = 16, rows = Math.ceil(v.num_blocks / cols), size = 36;
      pool.setAttribute("viewBox", "0 0 " + cols * size + " " + rows * size);
      while (pool.firstChild) pool.removeChild(pool.firstChild);
      for (var b = 0; b < v.num_blocks; b++) {
        var x = (b % cols) * size, y = Math.floor(b / cols) * size;
        var held = owner[b] !== undefined;
        var color = !held ? "var(--mbe-idle)" : owner[b] === -1 ? SHARED : PALETTE[owner[b] % PALETTE.length];
        MBE.svg("rect", { x: x + 1, y: y + 1, width: size - 2, height: size - 2, rx: 3,
          style: "fill:var(--mbe-idle);stroke:" + (held ? color : "none") + ";stroke-width:2" }, pool);
        if (held) {
          var f = (s.filled[b] || 0) / v.block_size;
          MBE.svg("rect", { x: x + 3, y: y + 3 + (size - 6) * (1 - f), width: size - 6, height: (size - 6) * f,
            style: "fill:" + color + ";opacity:0.85" }, pool);
        }
        MBE.svg("text", { x: x + size / 2, y: y + size / 2 + 4, "text-anchor": "middle",
          style: "font-size:12px" + (held ? HALO : ";opacity:0.45") }, pool,
          String(b) + (c.refs[b] > 1 ? "×" + c.refs[b] : ""));
      }
      // the tables
      while (tables.firstChild) tables.removeChild(tables.firstChild);
      var head = MBE.el("tr", {}, tables);
      ["request", "tokens", "blocks"].forEach(function (h) { MBE.el("th", {}, head, h); });
      Object.keys(s.tables).forEach(function (r) {
        var tr = MBE.el("tr", {}, tables);
        var td = MBE.el("td", {}, tr);
        MBE.el("span", { "class": "mbe-swatch", style: "background:" + PALETTE[Number(r) % PALETTE.length] }, td);
        td.appendChild(document.createTextNode(v.requests[Number(r)]));
        var tok = 0;
        s.tables[r].forEach(function (b) { tok += s.filled[b] || 0; });
        MBE.el("td", {}, tr, String(tok));
        MBE.el("td", { style: "text-align:left" }, tr, "[" + s.tables[r].map(function (b) {
          return c.refs[b] > 1 ? b + "*" : String(b);
        }).join(", ") + "]");
      });
      if (!Object.keys(s.tables).length) MBE.el("td", { colspan: 3 }, MBE.el("tr", {}, tables), "(every request has finished)");
      // paged against reserved
      while (memTable.firstChild) memTable.removeChild(memTable.firstChild);
      var h2 = MBE.el("tr", {}, memTable);
      ["KV cache", "slots held", "tokens", "share holding a token"].forEach(function (h) { MBE.el("th", {}, h2, h); });
      var rowsOut = [["paged", c.blocks * v.block_size], ["reserved (max_model_len " + v.max_model_len + " per request)",
        c.requests * v.max_model_len]];
      rowsOut.forEach(function (rw) {
        var tr = MBE.el("tr", {}, memTable);
        MBE.el("td", {}, tr, rw[0]);
        MBE.el("td", {}, tr, String(rw[1]));
        MBE.el("td", {}, tr, String(c.tokens));
        MBE.el("td", {}, tr, rw[1] ? (100 * c.tokens / rw[1]).toFixed(1) + "%" : "-");
      });
    };
    if (d.variants.length > 1) {
      variant = MBE.control(root, box, { name: "variant", label: "run", type: "select", value: 0,
        options: d.variants.map(function (v, i) { return [i, v.label]; }) }, function () { if (step) show(); });
    }
    step = MBE.control(root, box, { name: "step", label: "step t", type: "range", min: 0,
      max: d.variants[0].steps.length - 1, value: d.step }, show);
    MBE.legend(view, [["a request's block (filled to its tokens)", PALETTE[0]], ["shared by several (×refs)", SHARED],
      ["free", "var(--mbe-idle)"]]);
    show();
  };
})();
