// Applied before first paint (a classic script in <head>), so a saved theme never flashes.
(function () {
  var t = null;
  try { t = localStorage.getItem("elastrain.theme"); } catch (e) { /* storage disabled */ }
  if (t === "light" || t === "dark") document.documentElement.dataset.theme = t;
})();
