// Latency distributions side by side (chapters 7 and 8): per-request TTFT and
// TPOT of several runs; the reader picks the group (a class, a rate), a
// percentile and the SLO; the page computes each run's percentiles
// (numpy's linear rule, MBE.percentile), the share meeting the SLO (of the
// steady-state window's arrivals where the run has a window, else of every
// request) and, with a window, goodput (vLLM: requests/s meeting every SLO).
// data: {selectors: [{name, label, type, options: [text...], value}],
//   cells: {"i[,j]": [{key, label, color, ttft: [ms|null], tpot|e2el: [ms|null],
//                      arrival: [s], window: [a, b]}]},
//   metrics: [[key, label]], slo: {key: {label, values: [ms...], value}},
//   cell_slo: {"i[,j]": {key: ms}}, percentile, note}
(function () {
  var MBE = window.MBE;
  // Requests meeting every SLO (a missing TPOT, one output token, passes).
  MBE.meets = function (run, i, slo) {
    if (run.ttft[i] === null) return false;
    for (var k in slo) {
      var v = run[k][i];
      if (k === "tpot" && v === null) v = 0;
      if (v === null || v > slo[k]) return false;
    }
    return true;
  };
  // steady-state goodput: good arrivals in (start, end], per second
  MBE.goodput = function (run, slo) {
    var a = run.window[0], b = run.window[1], good = 0, n = 0;
    for (var i = 0; i < run.arrival.length; i++) {
      if (run.arrival[i] > a && run.arrival[i] <= b) {
        n++;
        if (MBE.meets(run, i, slo)) good++;
      }
    }
    return { goodput: good / (b - a), attainment: n ? good / n : NaN };
  };
  // the share meeting the SLO: of the window's arrivals where the run has a
  // window (the sweep's steady_slo_attainment), else of every request
  MBE.attainment = function (run, slo) {
    if (run.window) return MBE.goodput(run, slo).attainment;
    var good = 0, n = run.ttft.length;
    for (var j = 0; j < n; j++) if (MBE.meets(run, j, slo)) good++;
    return n ? good / n : NaN;
  };
  MBE.kinds.latency = function (root, d) {
    var box = MBE.el("div", { "class": "mbe-controls" }, root);
    var view = MBE.el("div", { "class": "mbe-view" }, root);
    // the plot's frame, in viewBox units; on a phone (the same query as the
    // axis text's size in explorables.css) a taller plot with wider margins
    var W = 600, H = 200, T = 10, L = 40, B = 22, FS = 13;
    var phone = window.matchMedia ? window.matchMedia("(max-width: 480px)") : { matches: false };
    var svg = MBE.svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img",
      "aria-label": "cumulative distribution of " + d.metrics[0][1] }, view);
    var caption = MBE.el("p", { "class": "mbe-note" }, view);
    var legend = MBE.el("div", {}, view);
    // a table wider than the box scrolls inside it, with shadows and a note that say so
    // (styled here, not in explorables.css, which every explorable inlines)
    var scroller = MBE.el("div", { "class": "mbe-scroll", style: "overflow-x:auto;max-width:100%;" +
      "background:linear-gradient(to right,var(--mbe-bg) 30%,transparent) left/2rem 100%," +
      "linear-gradient(to left,var(--mbe-bg) 30%,transparent) right/2rem 100%," +
      "radial-gradient(farthest-side at 0 50%,rgba(0,0,0,.3),transparent) left/.8rem 100%," +
      "radial-gradient(farthest-side at 100% 50%,rgba(0,0,0,.3),transparent) right/.8rem 100%;" +
      "background-repeat:no-repeat;background-attachment:local,local,scroll,scroll" }, view);
    var table = MBE.el("table", {}, scroller);
    var cue = MBE.el("p", { "class": "mbe-note mbe-scroll-cue", hidden: "" }, view,
      "\u2194 The table scrolls sideways.");
    var note = MBE.el("p", { "class": "mbe-note" }, view, d.note || "");
    var ctl = {};
    var cell = function () {
      return d.cells[d.selectors.map(function (s) { return ctl[s.name].value; }).join(",")];
    };
    var sortedOf = function (xs) {
      return xs.filter(function (x) { return x !== null; }).sort(function (a, b) { return a - b; });
    };
    var draw = function () {
      var runs = cell(), p = Number(ctl.percentile.value), slo = {};
      if (phone.matches) { H = 380; T = 26; L = 58; B = 44; FS = 22; } else { H = 200; T = 10; L = 40; B = 22; FS = 13; }
      svg.setAttribute("viewBox", "0 0 " + W + " " + H);
      for (var k in d.slo) slo[k] = d.slo[k].values[Number(ctl["slo_" + k].value)];
      // the CDF of the first metric, log x axis
      var m0 = d.metrics[0][0], lo = Infinity, hi = -Infinity;
      var sorted = runs.map(function (r) { return sortedOf(r[m0]); });
      sorted.forEach(function (s) { if (s.length) { lo = Math.min(lo, s[0]); hi = Math.max(hi, s[s.length - 1]); } });
      lo = Math.min(lo, slo[m0]); hi = Math.max(hi, slo[m0]);
      lo = Math.pow(10, Math.floor(Math.log10(Math.max(lo, 1e-3))));
      hi = Math.pow(10, Math.ceil(Math.log10(Math.max(hi, lo * 10))));
      var X = function (v) { return L + (W - L - 8) * (Math.log10(Math.max(v, lo)) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo)); };
      var Y = function (q) { return T + (H - B - T) * (1 - q); };
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      // a label every `every` decades, so that labels (up to 6 characters,
      // about 0.6 FS wide each) never touch
      var decades = Math.round(Math.log10(hi) - Math.log10(lo));
      var every = Math.max(1, Math.ceil(4.4 * FS / ((W - L - 8) / Math.max(decades, 1))));
      for (var e = Math.log10(lo), i = 0; e <= Math.log10(hi) + 1e-9; e++, i++) {
        var x = X(Math.pow(10, e));
        MBE.svg("line", { x1: x, x2: x, y1: T, y2: H - B, style: "stroke:var(--mbe-border);stroke-width:0.6" }, svg);
        if ((decades - i) % every) continue;  // the last decade is always labelled
        var v = Math.pow(10, e);
        var edge = e > Math.log10(hi) - 0.5 ? "end" : e < Math.log10(lo) + 0.5 ? "start" : "middle";
        MBE.svg("text", { x: x, y: H - B + FS + 3, "text-anchor": edge, "class": "mbe-axis" }, svg,
          v >= 1000 ? (v / 1000) + " s" : v + " ms");
      }
      [0, 0.5, 1].forEach(function (q) {
        MBE.svg("text", { x: L - 6, y: Y(q) + 0.35 * FS, "text-anchor": "end", "class": "mbe-axis" }, svg, String(q));
      });
      MBE.svg("line", { x1: L, x2: W - 8, y1: Y(p / 100), y2: Y(p / 100),
        style: "stroke:var(--mbe-muted);stroke-dasharray:4 3" }, svg);
      MBE.svg("line", { x1: X(slo[m0]), x2: X(slo[m0]), y1: T, y2: H - B,
        style: "stroke:var(--mbe-fg);stroke-width:1.5" }, svg);
      sorted.forEach(function (s, i) {
        if (!s.length) return;
        var pts = [[X(s[0]), Y(0)]];
        s.forEach(function (v, j) { pts.push([X(v), Y(j / s.length)]); pts.push([X(v), Y((j + 1) / s.length)]); });
        MBE.svg("polyline", { points: pts.map(function (q) { return q[0].toFixed(1) + "," + q[1].toFixed(1); }).join(" "),
          style: "fill:none;stroke-width:2;stroke:" + runs[i].color }, svg);
      });
      caption.textContent = "The share of requests (y) with " + d.metrics[0][1] + " up to x (log scale). " +
        "Vertical line: the " + d.metrics[0][1] + " SLO; dashed: the percentile.";
      while (legend.firstChild) legend.removeChild(legend.firstChild);
      MBE.legend(legend, runs.map(function (r) { return [r.label, r.color]; }));
      // the table: a row per run
      while (table.firstChild) table.removeChild(table.firstChild);
      var head = MBE.el("tr", {}, table);
      var cols = [""].concat(d.metrics.map(function (m) { return m[1] + " p" + p + " (ms)"; }), ["met the SLO"]);
      var withGoodput = runs.some(function (r) { return r.window; });
      if (withGoodput) cols.push("goodput (req/s)");
      cols.forEach(function (c) { MBE.el("th", {}, head, c); });
      runs.forEach(function (r, i) {
        var tr = MBE.el("tr", {}, table);
        MBE.el("td", {}, tr, r.label);
        d.metrics.forEach(function (m) {
          var v = MBE.percentile(sortedOf(r[m[0]]), p);
          var td = MBE.el("td", {}, tr);
          MBE.out(td, r.key + "-" + m[0])(v, MBE.fmt(v, v < 100 ? 1 : 0));
        });
        // with a steady-state window, the share of the window's arrivals
        // (steady_slo_attainment); without one, of every request
        var met = MBE.attainment(r, slo);
        MBE.out(MBE.el("td", {}, tr), r.key + "-met")(met, (100 * met).toFixed(1) + "%");
        if (withGoodput) {
          var g = r.window ? MBE.goodput(r, slo).goodput : NaN;
          MBE.out(MBE.el("td", {}, tr), r.key + "-goodput")(g, MBE.fmt(g, 1));
        }
      });
      showCue();
    };
    var showCue = function () {
      if (scroller.scrollWidth > scroller.clientWidth + 1) cue.removeAttribute("hidden");
      else cue.setAttribute("hidden", "");
    };
    if (phone.addEventListener) phone.addEventListener("change", function () { if (ctl.ready) draw(); });
    window.addEventListener("resize", showCue);
    // a group (a class) may come with its own SLO: the SLO sliders move to it
    var ownSlo = function () {
      var key = d.selectors.map(function (s) { return ctl[s.name].value; }).join(",");
      var own = d.cell_slo && d.cell_slo[key];
      if (!own) return;
      for (var k in own) {
        ctl["slo_" + k].value = d.slo[k].values.indexOf(own[k]);
        ctl["slo_" + k].mbeUpdateLabel();
      }
    };
    d.selectors.forEach(function (s) {
      ctl[s.name] = MBE.control(root, box, s.type === "range" ?
        { name: s.name, label: s.label, type: "range", min: 0, max: s.options.length - 1, value: s.value,
          format: function (v) { return s.options[v]; } } :
        { name: s.name, label: s.label, type: "select", value: s.value,
          options: s.options.map(function (o, i) { return [i, o]; }) },
        function () { if (ctl.percentile) { ownSlo(); draw(); } });
    });
    ctl.percentile = MBE.control(root, box, { name: "percentile", label: "percentile", type: "range",
      min: 1, max: 99, value: d.percentile, format: function (v) { return "p" + v; } }, draw);
    Object.keys(d.slo).forEach(function (k) {
      var s = d.slo[k];
      ctl["slo_" + k] = MBE.control(root, box, { name: "slo_" + k, label: s.label + " SLO", type: "range",
        min: 0, max: s.values.length - 1, value: s.values.indexOf(s.value),
        format: function (v) { var x = s.values[v]; return x >= 1000 ? x / 1000 + " s" : x + " ms"; } },
        function () { if (ctl.ready) draw(); });
    });
    ctl.ready = true;
    ownSlo();
    draw();
  };
})();
