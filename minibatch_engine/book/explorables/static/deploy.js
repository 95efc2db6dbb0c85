// Chapter 14: the deployment explorer. Every setting is a stored planner run
// (minibatch_engine/book/big_models.deploy_point); the page looks it up.
// data: {models, gpus, tps, pps, rates, slos: {model: [ttft, tpot]},
//        results: {"model|gpu|tp|pp|rate": {ok, gpus, replicas, ttft_ms, tpot_ms,
//        cost_per_mtok} or {ok: false, why}}, default}
(function () {
  var MBE = window.MBE;
  // The grid's key of a setting, as Python writes it: "|".join(map(str, key)).
  MBE.deployKey = function (model, gpu, tp, pp, rate) {
    return [model, gpu, String(tp), String(pp), Number.isInteger(rate) ? rate.toFixed(1) : String(rate)].join("|");
  };
  MBE.kinds.deploy = function (root, d) {
    var box = MBE.el("div", { "class": "mbe-controls" }, root);
    var view = MBE.el("div", { "class": "mbe-view" }, root);
    var outs = MBE.el("div", { "class": "mbe-outs" }, view);
    var showGpus = MBE.out(outs, "gpus", "GPUs:");
    var showTtft = MBE.out(outs, "ttft_ms", "p90 TTFT:");
    var showTpot = MBE.out(outs, "tpot_ms", "p90 TPOT:");
    var showCost = MBE.out(outs, "cost_per_mtok", "cost:");
    var W = 640, H = 40;
    var svg = MBE.svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img",
      "aria-label": "the deployment's GPUs, one square each, grouped by replica" }, view);
    var note = MBE.el("p", { "class": "mbe-note" }, view);
    var ctl = {};
    var select = function (name, label, values) {
      ctl[name] = MBE.control(root, box, { name: name, label: label, type: "select",
        options: values.map(function (v) { return [String(v), String(v)]; }),
        value: d.default[name] }, draw);
    };
    function draw() {
      if (!ctl.rate) return;
      var rate = d.rates[Number(ctl.rate.value)];
      var key = MBE.deployKey(ctl.model.value, ctl.gpu.value, ctl.tp.value, ctl.pp.value, rate);
      var r = d.results[key], slo = d.slos[ctl.model.value];
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      if (!r || !r.ok) {
        [showGpus, showTtft, showTpot, showCost].forEach(function (show) { show(NaN, "-"); });
        note.textContent = "No plan at this setting: " + (r ? r.why : "not computed") + ".";
        return;
      }
      showGpus(r.gpus, r.gpus + " (" + r.replicas + " × " + ctl.tp.value + " × " + ctl.pp.value + ")");
      showTtft(r.ttft_ms, Math.round(r.ttft_ms).toLocaleString("en-US") + " ms");
      showTpot(r.tpot_ms, r.tpot_ms.toFixed(1) + " ms");
      showCost(r.cost_per_mtok, "$" + r.cost_per_mtok.toFixed(2) + " per M output tokens");
      var per = r.gpus / r.replicas, size = Math.min(12, (W - 4) / (r.gpus + r.replicas)), x = 2;
      for (var i = 0; i < r.replicas; i++) {
        for (var j = 0; j < per; j++) {
          MBE.svg("rect", { x: x, y: 4, width: size - 1.5, height: size - 1.5,
            style: "fill:var(--mbe-" + (j % 2 ? "decode" : "prefill") + ")" }, svg);
          x += size;
        }
        x += size;
      }
      note.textContent = "Azure conversation trace, 200 requests at " + rate + " req/s, token budget 2,048. " +
        "SLO: p90 TTFT ≤ " + slo[0] + " ms, p90 TPOT ≤ " + slo[1] + " ms. Squares: GPUs, grouped by replica.";
    }
    select("model", "model", d.models);
    select("gpu", "GPU", d.gpus);
    select("tp", "tensor parallel (TP)", d.tps);
    select("pp", "pipeline stages (PP)", d.pps);
    ctl.rate = MBE.control(root, box, { name: "rate", label: "requests/s", type: "range", min: 0,
      max: d.rates.length - 1, value: d.default.rate,
      format: function (v) { return String(d.rates[v]); } }, draw);
    draw();
  };
})();
