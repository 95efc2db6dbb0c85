// Chapter 2: eta of static batching, from a length distribution and a batch size.
// data: {prompt_lengths: [[..per request] per sigma], outputs: [[...] per sigma],
//        sigmas: [...], sigma: index, batch: B, max_batch}
(function () {
  var MBE = window.MBE;
  // The padded layout of one static batch (efficiency.padded_token_counts):
  // useful = sum(p + g - 1), computed = B * (P + G - 1).
  MBE.etaRun = function (prompts, outputs, B) {
    var useful = 0, computed = 0;
    for (var i = 0; i < prompts.length; i += B) {
      var P = 0, G = 0, u = 0, n = 0;
      for (var j = i; j < Math.min(i + B, prompts.length); j++) {
        P = Math.max(P, prompts[j]); G = Math.max(G, outputs[j]);
        u += prompts[j] + outputs[j] - 1; n++;
      }
      useful += u; computed += n * (P + G - 1);
    }
    return { useful: useful, computed: computed, eta: useful / computed };
  };
  MBE.kinds.eta = function (root, d) {
    var box = MBE.el("div", { "class": "mbe-controls" }, root);
    var view = MBE.el("div", { "class": "mbe-view" }, root);
    var outs = MBE.el("div", { "class": "mbe-outs" }, view);
    var showEta = MBE.out(outs, "eta", "η =");
    var showRows = MBE.out(outs, "padding", "padding rows:");
    var note = MBE.el("p", { "class": "mbe-note" }, view);
    var W = 640, lane = 3, H = d.outputs[0].length * lane;
    var svg = MBE.svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img",
      "aria-label": "padded layout of the static batches" }, view);
    var axis = MBE.el("p", { "class": "mbe-note" }, view);
    MBE.legend(view, [["prompt", "var(--mbe-prefill)"], ["decoded token", "var(--mbe-decode)"],
      ["padding", "var(--mbe-pad)"]]);
    var sigma, batch;
    var draw = function () {
      var k = Number(sigma.value), B = Number(batch.value);
      var p = d.prompt_lengths[k], g = d.outputs[k], n = g.length;
      var r = MBE.etaRun(p, g, B);
      showEta(r.eta, r.eta.toFixed(3));
      showRows(r.computed - r.useful, (r.computed - r.useful).toLocaleString("en-US") +
        " of " + r.computed.toLocaleString("en-US"));
      note.textContent = n + " requests in " + Math.ceil(n / B) + " batches of " + B +
        ". Each row is one request's lane; each batch is as wide as its longest prompt plus its longest output.";
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      var widest = 1, b, j;
      for (b = 0; b < n; b += B) {
        var P = 0, G = 0;
        for (j = b; j < Math.min(b + B, n); j++) { P = Math.max(P, p[j]); G = Math.max(G, g[j]); }
        widest = Math.max(widest, P + G - 1);
      }
      var sx = (W - 4) / widest;
      var rect = function (x, y, w, cls) {
        if (w > 0) MBE.svg("rect", { x: 2 + x * sx, y: y, width: w * sx, height: lane - 0.4,
          style: "fill:var(--mbe-" + cls + ")" }, svg);
      };
      for (b = 0; b < n; b += B) {
        var P2 = 0, G2 = 0;
        for (j = b; j < Math.min(b + B, n); j++) { P2 = Math.max(P2, p[j]); G2 = Math.max(G2, g[j]); }
        for (j = b; j < Math.min(b + B, n); j++) {
          var y = j * lane;
          rect(0, y, P2 - p[j], "pad");              // left padding to the longest prompt
          rect(P2 - p[j], y, p[j], "prefill");       // the prompt
          rect(P2, y, g[j] - 1, "decode");           // decoded tokens fed back
          rect(P2 + g[j] - 1, y, G2 - g[j], "pad");  // finished, waiting for the batch
        }
        if (b > 0) MBE.svg("line", { x1: 0, x2: W, y1: b * lane - 0.2, y2: b * lane - 0.2,
          style: "stroke:var(--mbe-fg);stroke-width:0.5;opacity:0.6" }, svg);
      }
      axis.textContent = "The widest batch spans " + widest + " token positions (columns).";
    };
    sigma = MBE.control(root, box, { name: "sigma", label: "σ of log(output length)", type: "range",
      min: 0, max: d.sigmas.length - 1, value: d.sigma,
      format: function (v) { return d.sigmas[v].toFixed(2); } }, draw);
    batch = MBE.control(root, box, { name: "batch", label: "batch size B", type: "range",
      min: 1, max: d.max_batch, value: d.batch }, draw);
    draw();
  };
})();
