// minibatch-engine explorables: the shared runtime (no libraries, no network).
// Each explorable is a <div class="mbe-explorable" data-kind=...> holding its
// data as JSON; MBE.mount(id) builds its controls and view. The browser check
// (tools/check_explorables.py) reads what outputs show from data-value.
(function () {
  var MBE = window.MBE = window.MBE || { kinds: {} };
  if (MBE.svg) return; // the runtime is defined once per page
  var NS = "http://www.w3.org/2000/svg";
  MBE.el = function (tag, attrs, parent, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  };
  MBE.svg = function (tag, attrs, parent, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  };
  // A labelled control. spec: {name, label, type: "range"|"select", min, max,
  // step, value, options: [[value, text]...], format(v) -> text shown}.
  MBE.control = function (root, box, spec, onchange) {
    var id = root.id + "-" + spec.name;
    var row = MBE.el("div", { "class": "mbe-control" }, box);
    MBE.el("label", { "for": id }, row, spec.label);
    var input;
    if (spec.type === "select") {
      input = MBE.el("select", { id: id, name: spec.name }, row);
      spec.options.forEach(function (o) {
        var opt = MBE.el("option", { value: String(o[0]) }, input, o[1]);
        if (String(o[0]) === String(spec.value)) opt.selected = true;
      });
    } else {
      input = MBE.el("input", { id: id, name: spec.name, type: "range", min: spec.min,
        max: spec.max, step: spec.step || 1, value: spec.value }, row);
    }
    var shown = spec.type === "select" ? MBE.el("span", {}) :  // a select shows its value itself
      MBE.el("output", { "for": id, "class": "mbe-value" }, row);
    var update = function () {
      var v = spec.type === "select" ? input.value : Number(input.value);
      var text = spec.format ? spec.format(v) : String(v);
      shown.textContent = text;
      if (spec.type !== "select") input.setAttribute("aria-valuetext", text);
      onchange();
    };
    input.addEventListener("input", update);
    input.addEventListener("change", update);
    input.mbeUpdateLabel = function () {
      var v = spec.type === "select" ? input.value : Number(input.value);
      shown.textContent = spec.format ? spec.format(v) : String(v);
    };
    input.mbeUpdateLabel();
    return input;
  };
  // An output figure: visible text, and its exact value for the check.
  MBE.out = function (parent, key, label) {
    var row = MBE.el("div", { "class": "mbe-out" }, parent);
    if (label) MBE.el("span", { "class": "mbe-out-label" }, row, label + " ");
    var v = MBE.el("strong", { "data-out": key }, row);
    return function (value, text) {
      v.setAttribute("data-value", String(value));
      v.textContent = text;
    };
  };
  // numpy.percentile's default (linear interpolation between order statistics)
  MBE.percentile = function (sorted, p) {
    var n = sorted.length;
    if (!n) return NaN;
    var pos = (p / 100) * (n - 1), lo = Math.floor(pos), hi = Math.ceil(pos);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo);
  };
  MBE.fmt = function (x, digits) { return isFinite(x) ? x.toFixed(digits) : "-"; };
  // A horizontal legend of colour swatches.
  MBE.legend = function (parent, items) {
    var box = MBE.el("div", { "class": "mbe-legend" }, parent);
    items.forEach(function (it) {
      var s = MBE.el("span", { "class": "mbe-swatch-item" }, box);
      MBE.el("span", { "class": "mbe-swatch", style: "background:" + it[1] }, s);
      s.appendChild(document.createTextNode(it[0]));
    });
    return box;
  };
  // Mount the explorable around the running script (JupyterLab may show one
  // notebook twice: ids repeat), else the one with this id.
  MBE.mount = function (id, script) {
    var root = script && script.parentElement && script.parentElement.id === id ?
      script.parentElement : document.getElementById(id);
    if (!root || root.getAttribute("data-mounted")) return;
    var kind = MBE.kinds[root.getAttribute("data-kind")];
    var data = JSON.parse(root.querySelector("script.mbe-data").textContent);
    root.setAttribute("data-mounted", "1");
    var fallback = root.querySelector(".mbe-fallback");
    if (fallback) fallback.remove();
    kind(root, data);
  };
})();
