// A step scrubber over engine traces (chapters 3, 5, 6): rows (KV rows or
// requests) against steps, coloured by what each computes; a step slider
// shows who is in the batch at step t, the step's events and figures.
// data: {kinds: [[name, css colour]...], row_label, variants: [{label, panels: [
//   {key, label, rows: [..], requests: [..], steps: [[[row, kind, tokens, req]...]...],
//    events: {step: [text...]}, series: [{key, label, unit, digits, values: [...], max}]}
// ]}], variant, step}
(function () {
  var MBE = window.MBE;
  // the lane that names each row's state in a step: its first lane that is not
  // padding (a prefill lane that also carries pad tokens shows as prefill, as
  // in the chapter's figure), else its first lane; {row: lane}
  MBE.rowStates = function (lanes, kinds) {
    var pick = {};
    lanes.forEach(function (l) {
      var q = pick[l[0]];
      if (!q || (kinds[q[1]][0] === "pad" && kinds[l[1]][0] !== "pad")) pick[l[0]] = l;
    });
    return pick;
  };
  MBE.kinds.timeline = function (root, d) {
    var box = MBE.el("div", { "class": "mbe-controls" }, root);
    var view = MBE.el("div", { "class": "mbe-view" }, root);
    var used = {};
    d.variants.forEach(function (v) { v.panels.forEach(function (p) { p.steps.forEach(function (ls) {
      ls.forEach(function (l) { used[l[1]] = 1; }); }); }); });
    MBE.legend(view, d.kinds.filter(function (k, i) { return used[i]; }));
    var panelsBox = MBE.el("div", { "class": "mbe-panels" }, view);
    var variant = null, step = null, drawn = null, panels = [];
    var W = 600;
    var build = function () {
      var v = d.variants[variant ? Number(variant.value) : d.variant];
      var n = Math.max.apply(null, v.panels.map(function (p) { return p.steps.length; }));
      if (step) {
        step.max = n - 1;
        if (Number(step.value) > n - 1) step.value = n - 1;
      }
      while (panelsBox.firstChild) panelsBox.removeChild(panelsBox.firstChild);
      panels = v.panels.map(function (p) {
        var el = MBE.el("div", { "class": "mbe-panel" }, panelsBox);
        MBE.el("div", { "class": "mbe-title" }, el, p.label);
        var rows = p.rows.length, rh = Math.max(3, Math.min(14, 150 / rows)), H = rows * rh;
        var svg = MBE.svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img",
          "aria-label": p.label + ": " + rows + " " + d.row_label + "s against " + p.steps.length + " steps" }, el);
        var sx = W / n;
        // runs of one (row, kind, request) over consecutive steps: one rectangle each
        var open = {};
        var flush = function (r) {
          var o = open[r];
          if (o) MBE.svg("rect", { x: o.t0 * sx, y: r * rh + 0.3, width: (o.t1 - o.t0 + 1) * sx - 0.2,
            height: rh - 0.6, style: "fill:" + d.kinds[o.kind][1] }, svg);
          delete open[r];
        };
        p.steps.forEach(function (lanes, t) {
          var seen = {}, pick = MBE.rowStates(lanes, d.kinds);
          lanes.forEach(function (l) {
            var r = l[0], o = open[r];
            if (pick[r] !== l) return;
            seen[r] = 1;
            if (o && o.kind === l[1] && o.req === l[3] && o.t1 === t - 1) { o.t1 = t; return; }
            flush(r);
            open[r] = { t0: t, t1: t, kind: l[1], req: l[3] };
          });
          Object.keys(open).forEach(function (r) { if (!seen[r]) flush(r); });
        });
        Object.keys(open).forEach(flush);
        var cursor = MBE.svg("rect", { y: 0, height: H, width: Math.max(sx, 1.5),
          style: "fill:none;stroke:var(--mbe-cursor);stroke-width:1.2" }, svg);
        var outs = MBE.el("div", { "class": "mbe-outs" }, el);
        var o = {
          p: p, cursor: cursor, sx: sx, W: W,
          stepRows: MBE.out(outs, p.key + "-step-rows", "tokens computed this step:"),
          rowsSoFar: MBE.out(outs, p.key + "-rows", "tokens computed so far:"),
          padSoFar: p.pad ? MBE.out(outs, p.key + "-pad", "padding so far:") : function () {},
          series: (p.series || []).map(function (s) {
            return { s: s, at: MBE.out(outs, p.key + "-" + s.key, s.label + ":"),
                     max: s.max ? MBE.out(outs, p.key + "-" + s.key + "-max", "largest in the run:") : null };
          }),
          status: MBE.el("p", { "class": "mbe-note" }, el),
          table: MBE.el("table", {}, el),
        };
        return o;
      });
      drawn = v;
    };
    var kindName = function (k) { return d.kinds[k][0]; };
    var show = function () {
      if (!drawn || drawn !== d.variants[variant ? Number(variant.value) : d.variant]) build();
      step.mbeUpdateLabel();
      var t = Number(step.value), byReq = d.row_label === "request";
      panels.forEach(function (o) {
        var p = o.p, last = p.steps.length - 1, tt = Math.min(t, last);
        o.cursor.setAttribute("x", Math.min(t * o.sx, o.W - Math.max(o.sx, 1.5)));
        var rows = 0, pad = 0, here = 0;
        for (var s = 0; s <= tt; s++) {
          p.steps[s].forEach(function (l) {
            if (kindName(l[1]) === "prefill" || kindName(l[1]) === "decode" || kindName(l[1]) === "pad") {
              rows += l[2];
              if (kindName(l[1]) === "pad") pad += l[2];
              if (s === t) here += l[2];
            }
          });
        }
        o.stepRows(here, t > last ? "- (done)" : here.toLocaleString("en-US"));
        o.rowsSoFar(rows, rows.toLocaleString("en-US"));
        o.padSoFar(pad, pad.toLocaleString("en-US"));
        o.series.forEach(function (x) {
          var val = x.s.values[tt];
          if (x.s.cumulative) {  // the sum of the steps up to t
            val = 0;
            for (var k = 0; k <= tt; k++) val += x.s.values[k] || 0;
          }
          var txt = val === null || val === undefined ? "-" : MBE.fmt(val, x.s.digits) + (x.s.unit ? " " + x.s.unit : "");
          x.at(val === null || val === undefined ? NaN : val, txt);
          if (x.max) {
            var m = -Infinity;
            x.s.values.forEach(function (y) { if (y !== null && y > m) m = y; });
            x.max(m, MBE.fmt(m, x.s.digits) + (x.s.unit ? " " + x.s.unit : ""));
          }
        });
        var ev = (p.events && p.events[String(tt)]) || [];
        o.status.textContent = (t > last ? "Finished after " + (last + 1) + " steps. " :
          "Step " + t + " of " + (last + 1) + ". ") + ev.join("; ");
        var tab = o.table;
        while (tab.firstChild) tab.removeChild(tab.firstChild);
        var head = MBE.el("tr", {}, tab);
        (byReq ? [d.row_label, "this step"] : [d.row_label, "request", "this step"]).forEach(function (h) { MBE.el("th", {}, head, h); });
        var byRow = {};
        if (t <= last) p.steps[t].forEach(function (l) { (byRow[l[0]] = byRow[l[0]] || []).push(l); });
        p.rows.forEach(function (label, r) {
          var ls = byRow[r] || [];
          var tr = MBE.el("tr", {}, tab);
          MBE.el("td", {}, tr, label);
          if (!byReq) MBE.el("td", {}, tr, ls.length ? p.requests[ls[ls.length - 1][3]] : "");
          MBE.el("td", {}, tr, ls.map(function (l) {
            var k = kindName(l[1]);
            return l[2] ? k + " " + l[2] + (l[2] === 1 ? " token" : " tokens") : k;
          }).join(" + ") || (p.finish && p.finish[String(r)] !== undefined && t > p.finish[String(r)] ?
            "finished" : "idle"));
        });
      });
    };
    if (d.variants.length > 1) {
      variant = MBE.control(root, box, { name: "variant", label: d.variant_label || "run", type: "select",
        value: d.variant, options: d.variants.map(function (v, i) { return [i, v.label]; }) }, show);
    }
    var n0 = Math.max.apply(null, d.variants[d.variant].panels.map(function (p) { return p.steps.length; }));
    step = MBE.control(root, box, { name: "step", label: "step t", type: "range", min: 0,
      max: n0 - 1, value: d.step }, show);
    show();
  };
})();
