// Chapter 13: the memory calculator. A port of minibatch_engine/book/memory_calculator.plan
// (and AttentionShape.kv_elements_per_token_layer); tests run both and compare.
// data: {models: {name: shape}, gpus: {name: {memory, bandwidth, flops}}, contexts: [...],
//        variants, kv_bytes, weight_bytes, activation_bytes, utilization, e_*, defaults}
(function () {
  var MBE = window.MBE;
  // Elements one token caches in one layer on one GPU of a tp-way group.
  MBE.kvElements = function (m, variant, tp) {
    var v = variant === "own" ? m.variant : variant;
    if (v === "MLA") return m.variant === "MLA" ? m.latent + m.rope : 4 * m.head_dim + Math.floor(m.head_dim / 2);
    var heads = v === "MHA" ? m.heads : v === "MQA" ? 1 :
      (m.variant === "GQA" ? m.kv_heads : Math.min(8, m.heads));
    return Math.ceil(heads / tp) * (m.head_dim + m.v_dim);
  };
  MBE.memoryPlan = function (d, s) {
    var m = d.models[s.model], g = d.gpus[s.gpu], tp = Number(s.gpus), context = s.context;
    var weights = ((m.parameters - m.embedding) * d.weight_bytes[s.weight] +
                   m.embedding * d.activation_bytes) / tp;
    var kvMemory = d.utilization * g.memory - weights;
    var perToken = m.layers * MBE.kvElements(m, s.variant, tp) * d.kv_bytes[s.kv];
    var batch = Math.max(0, Math.floor(kvMemory / (context * perToken)));
    var compute = 2 * m.active * batch / tp / (g.flops * d.e_compute);
    var memory = weights / (g.bandwidth * d.e_memory) +
      batch * context * perToken / (g.bandwidth * d.e_attention);
    var step = Math.max(compute, memory);
    return { weights_gb: weights / 1e9, kv_gb: Math.max(kvMemory, 0) / 1e9, kv_kib: perToken / 1024,
      max_batch: batch, step_ms: batch ? step * 1e3 : null, tokens_per_s: batch ? batch / step : 0,
      bound: compute > memory ? "compute" : "memory", memory_gb: g.memory / 1e9 };
  };
  MBE.kinds.memory = function (root, d) {
    var box = MBE.el("div", { "class": "mbe-controls" }, root);
    var view = MBE.el("div", { "class": "mbe-view" }, root);
    var outs = MBE.el("div", { "class": "mbe-outs" }, view);
    var showBatch = MBE.out(outs, "max_batch", "max batch:");
    var showKv = MBE.out(outs, "kv_kib", "KV per token:");
    var showW = MBE.out(outs, "weights_gb", "weights per GPU:");
    var showStep = MBE.out(outs, "step_ms", "decode step:");
    var showTps = MBE.out(outs, "tokens_per_s", "throughput:");
    var W = 640, H = 46;
    var svg = MBE.svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img",
      "aria-label": "one GPU's memory: weights, KV cache of the batch, unused" }, view);
    MBE.legend(view, [["weights", "var(--mbe-prefill)"], ["KV of the batch", "var(--mbe-decode)"],
      ["reserved (1 - utilization) or unused", "var(--mbe-idle)"]]);
    var note = MBE.el("p", { "class": "mbe-note" }, view);
    var ctl = {};
    var select = function (name, label, options, value) {
      ctl[name] = MBE.control(root, box, { name: name, label: label, type: "select",
        options: options, value: value }, draw);
    };
    var names = Object.keys(d.models), dflt = d.defaults;
    function state() {
      return { model: ctl.model.value, variant: ctl.variant.value, kv: ctl.kv.value, weight: ctl.weight.value,
        context: d.contexts[Number(ctl.context.value)], gpu: ctl.gpu.value, gpus: ctl.gpus.value };
    }
    function draw() {
      if (!ctl.gpus) return;
      var s = state(), r = MBE.memoryPlan(d, s);
      showBatch(r.max_batch, r.max_batch.toLocaleString("en-US") + " sequences");
      showKv(r.kv_kib, r.kv_kib.toFixed(1) + " KiB");
      showW(r.weights_gb, r.weights_gb.toFixed(1) + " GB");
      showStep(r.step_ms, r.max_batch ? r.step_ms.toFixed(1) + " ms (" + r.bound + "-bound)" : "-");
      showTps(r.tokens_per_s, r.max_batch ? Math.round(r.tokens_per_s).toLocaleString("en-US") + " tok/s" : "-");
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      var sx = (W - 4) / r.memory_gb, x = 2;
      var kvUsed = r.max_batch * s.context * r.kv_kib * 1024 / 1e9;
      [[Math.min(r.weights_gb, r.memory_gb), "prefill"], [kvUsed, "decode"]].forEach(function (p) {
        MBE.svg("rect", { x: x, y: 4, width: Math.max(0, p[0] * sx), height: 22,
          style: "fill:var(--mbe-" + p[1] + ")" }, svg);
        x += Math.max(0, p[0] * sx);
      });
      MBE.svg("rect", { x: x, y: 4, width: Math.max(0, W - 2 - x), height: 22, style: "fill:var(--mbe-idle)" }, svg);
      MBE.svg("text", { x: 2, y: 42, "class": "mbe-axis" }, svg,
        "one " + s.gpu + ": " + r.memory_gb.toFixed(0) + " GB");
      var m = d.models[s.model];
      note.textContent = r.max_batch ?
        s.model + " (" + (s.variant === "own" ? m.variant : s.variant + " at its shape") + ") at " +
        s.context.toLocaleString("en-US") + " tokens of context: the batch whose KV fills what the weights leave. " +
        "The step is a roofline with the simulator's fitted efficiencies (no all-reduce, no host time)." :
        "Nothing fits: the weights alone take more than " + Math.round(d.utilization * 100) +
        "% of each GPU, or one sequence's KV does not fit in what is left. Add GPUs or quantize.";
    }
    select("model", "model", names.map(function (n) { return [n, n + " (" + d.models[n].variant + ")"]; }),
      dflt.model);
    select("variant", "attention", d.variants.map(function (v) {
      return [v, v === "own" ? "as published" : v]; }), dflt.variant);
    select("kv", "KV dtype", Object.keys(d.kv_bytes).filter(function (k) { return k !== "fp8_e4m3"; })
      .map(function (k) { return [k, k === "auto" ? "bf16" : k]; }), dflt.kv);
    select("weight", "weights", Object.keys(d.weight_bytes).map(function (k) {
      return [k, k === "auto" ? "bf16" : k]; }), dflt.weight);
    ctl.context = MBE.control(root, box, { name: "context", label: "context (tokens)", type: "range",
      min: 0, max: d.contexts.length - 1, value: dflt.context,
      format: function (v) { return d.contexts[v].toLocaleString("en-US"); } }, draw);
    select("gpu", "GPU", Object.keys(d.gpus).map(function (g) { return [g, g]; }), dflt.gpu);
    select("gpus", "GPUs (tensor parallel)", [["1", "1"], ["2", "2"], ["4", "4"], ["8", "8"]], dflt.gpus);
    draw();
  };
})();
