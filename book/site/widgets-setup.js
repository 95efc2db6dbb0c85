// Loaded after require.js and before @jupyter-widgets/html-manager's
// embed-amd.js (see nb_ipywidgets_js in _config.yml); tools/offline_assets.py
// copies this file next to embed-amd.js and its Font Awesome files.
(function () {
  var here = document.currentScript.src.replace(/\/[^/]*$/, "");

  // 1. Where the widget bundle finds its fonts.  embed-amd.js defines its
  // modules by name, and each module's webpack public path (the folder its
  // CSS fetches fonts from) is the folder of the URI requirejs gives that
  // name: by default "<page folder>/@jupyter-widgets/...", which does not
  // exist, so the icon fonts 404.  Give every bundled module a URI in this
  // folder.  (window.__jupyter_widgets_assets_path__ comes too late in
  // html-manager 1.0.x: the CSS is injected before it is read.)
  var paths = { "@jupyter-widgets/html-manager/dist": here };
  ["base", "base7", "controls", "controls7", "html-manager"].forEach(function (m) {
    paths["@jupyter-widgets/" + m] = here + "/" + m;
  });
  window.require.config({ paths: paths });

  // 2. MathJax 3 on a page with widgets.  When MathJax is present, the
  // widgets typeset their descriptions with the MathJax 2 call
  // MathJax.Hub.Queue(["Typeset", MathJax.Hub, element]), which MathJax 3
  // lacks ("Cannot read properties of undefined (reading 'Queue')", with the
  // CDN setup too).  Sphinx loads MathJax with `defer`, so it is there by
  // "load", when the widget manager renders (this listener runs first).
  window.addEventListener("load", function () {
    var MJ = window.MathJax;
    if (!MJ || MJ.Hub || !MJ.startup || !MJ.startup.promise) return;
    MJ.Hub = {
      Queue: function (job) {
        var el = Array.isArray(job) ? job[2] : undefined;
        MJ.startup.promise = MJ.startup.promise
          .then(function () { return MJ.typesetPromise(el ? [el] : undefined); })
          .catch(function (err) { console.warn("MathJax typeset of a widget label failed:", err); });
      },
    };
  });
})();
