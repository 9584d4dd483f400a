
  pick.view.addEventListener("change", () => {
    state.view = Number(pick.view.value); state.hover = null; state.pair = null;
    fillDisplays(); fillLayerHead(); draw();
  });
  pick.layer.addEventListener("change", () => {
    state.layer = pick.layer.value === "rollout" ? "rollout" : Number(pick.layer.value); draw();
  });
  pick.head.addEventListener("change", () => { state.head = pick.head.value; draw(); });
  pick.display.addEventListener("change", () => {
    state.display = pick.display.value; state.hover = null; draw();
  });
  try {
    ARRAYS = await inflate(document.getElementById("qkv-arrays").textContent);
  } catch (error) {
    document.getElementById("info").textContent = "This page needs a browser with " +
      "DecompressionStream (Chrome 80+, Firefox 113+, Safari 16.4+): " + error;
    return;
  }
  const longest = Math.max(...META.views.map((v) => v.query_tokens.length));
  state.display = META.image ? "image" : META.views[0].row_stats ? "rows"
    : longest > LINE_LIMIT ? "matrix" : "lines";
  fillControls();
  draw();
  // Milliseconds from navigation to the first view drawn (the viz benchmark reads it).
  document.body.dataset.readyMs = String(Math.round(performance.now()));
  document.body.dataset.ready = "1";
