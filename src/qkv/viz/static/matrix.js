
  // The heatmap fits the window (at most 720 px square).
  const MATRIX = { size: Math.max(240, Math.min(720, window.innerWidth - 160,
                                                window.innerHeight - 240)),
                   left: 120, top: 90, thumb: 48 };
  const zoom = { scale: 1, x: 0, y: 0 };  // cell size multiplier; first visible column, row
  let cell = null;  // the cell under the pointer: {q, k}

  // Colour by sqrt(weight), white -> dark blue, looked up per 1/255 step (the stored
  // precision) as one 32-bit RGBA word: painting a head touches only its stored entries.
  const SHADES = new Uint32Array(256);
  const littleEndian = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;
  for (let i = 0; i < 256; i++) {
    const t = Math.sqrt(i / 255);
    const rgb = [255 - 247 * t, 255 - 207 * t, 255 - 148 * t].map(Math.round);
    SHADES[i] = littleEndian ? (255 << 24 | rgb[2] << 16 | rgb[1] << 8 | rgb[0]) >>> 0
      : (rgb[0] << 24 | rgb[1] << 16 | rgb[2] << 8 | 255) >>> 0;
  }
  function paintRows(rows, nq, nk, width, height, combine) {
    const canvas = document.createElement("canvas");
    canvas.width = width; canvas.height = height;
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(width, height);
    const pixels = new Uint32Array(image.data.buffer);
    const best = new Float32Array(width * height);
    const touched = [];
    rows.forEach((q, k, w) => {
      const i = Math.floor((q * height) / nq) * width + Math.floor((k * width) / nk);
      if (best[i] === 0) touched.push(i);
      best[i] = combine(best[i], w);
    });
    pixels.fill(SHADES[0]);
    for (const i of touched) pixels[i] = SHADES[Math.min(255, Math.round(best[i] * 255))];
    ctx.putImageData(image, 0, 0);
    return canvas;
  }
  function matrixItem() {
    const shown = matrices();
    // "all heads" is one colour per head in the head view; as a heatmap it is their mean.
    return shown.length > 1 ? { head: "mean", rows: meanRows(state.view, state.layer) } : shown[0];
  }
  // One pixel per weight, or, when a cell is smaller than a pixel, one pixel per block of
  // cells holding the block's largest weight (so a thin diagonal does not vanish).
  // A full-size image is Nq x Nk x 4 bytes (16 MB at 2,048 tokens): keep the newest few.
  const images = new Map();
  function matrixImage(item, block) {
    const v = view(), nq = v.query_tokens.length, nk = v.key_tokens.length;
    const key = state.view + "/" + state.layer + "/" + item.head + "/" + block;
    if (!images.has(key)) {
      if (images.size >= 12) images.delete(images.keys().next().value);
      images.set(key, paintRows(item.rows, nq, nk, Math.ceil(nk / block), Math.ceil(nq / block),
                                Math.max));
    }
    return images.get(key);
  }
  function cellSize(v) {
    return (MATRIX.size * zoom.scale) / Math.max(v.query_tokens.length, v.key_tokens.length);
  }
  function clampZoom(v) {
    const span = MATRIX.size / cellSize(v);
    zoom.x = Math.max(0, Math.min(zoom.x, v.key_tokens.length - span));
    zoom.y = Math.max(0, Math.min(zoom.y, v.query_tokens.length - span));
  }

  function paintMatrix(canvas) {
    const v = view(), item = matrixItem();
    const nq = v.query_tokens.length, nk = v.key_tokens.length, size = cellSize(v);
    const block = size < 1 ? Math.ceil(1 / size) : 1, image = matrixImage(item, block);
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.imageSmoothingEnabled = false;
    const cols = Math.min(nk - zoom.x, MATRIX.size / size);
    const rows = Math.min(nq - zoom.y, MATRIX.size / size);
    ctx.drawImage(image, zoom.x / block, zoom.y / block, cols / block, rows / block,
                  MATRIX.left, MATRIX.top, cols * size, rows * size);
    canvas.dataset.origin = JSON.stringify([MATRIX.left - zoom.x * size,
                                            MATRIX.top - zoom.y * size, size]);
    const x = (k) => MATRIX.left + (k - zoom.x) * size;
    const y = (q) => MATRIX.top + (q - zoom.y) * size;
    ctx.save();
    ctx.beginPath();
    ctx.rect(MATRIX.left, MATRIX.top, cols * size, rows * size);
    ctx.clip();
    if (v.first_generated !== null) {  // where the generated tokens begin
      ctx.strokeStyle = "#7d3c98"; ctx.setLineDash([4, 3]);
      ctx.beginPath(); ctx.moveTo(MATRIX.left, y(v.first_generated));
      ctx.lineTo(MATRIX.left + cols * size, y(v.first_generated)); ctx.stroke();
      ctx.setLineDash([]);
    }
    if (cell) {
      ctx.fillStyle = "rgba(241, 196, 15, 0.25)";
      ctx.fillRect(MATRIX.left, y(cell.q), cols * size, Math.max(1, size));
      ctx.fillRect(x(cell.k), MATRIX.top, Math.max(1, size), rows * size);
    }
    if (state.pair) {
      ctx.strokeStyle = "#c0392b"; ctx.lineWidth = 2;
      ctx.strokeRect(x(state.pair.k) - 1, y(state.pair.q) - 1, Math.max(2, size) + 2,
                     Math.max(2, size) + 2);
    }
    ctx.restore();
    // Token names along the axes once a cell is tall enough to hold one.
    ctx.fillStyle = "#222";
    ctx.font = "11px sans-serif";
    const step = Math.max(1, Math.ceil(11 / size));
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    for (let q = Math.floor(zoom.y); q < zoom.y + rows; q += step) {
      ctx.fillStyle = cell && cell.q === q ? "#c0392b" : "#222";
      ctx.fillText(v.query_tokens[q].slice(0, 16), MATRIX.left - 4, y(q) + size / 2);
    }
    ctx.save();
    ctx.textAlign = "left";
    for (let k = Math.floor(zoom.x); k < zoom.x + cols; k += step) {
      ctx.fillStyle = cell && cell.k === k ? "#c0392b" : "#222";
      ctx.setTransform(1, 0, 0, 1, x(k) + size / 2, MATRIX.top - 4);
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(v.key_tokens[k].slice(0, 14), 0, 0);
    }
    ctx.restore();
    ctx.fillStyle = "#666"; ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";
    ctx.fillText("keys (attended to) \u2192", MATRIX.left, 12);
    ctx.fillText("queries \u2193", 4, 12);
  }

  function describeCell(v, item, q, k) {
    const w = item.rows.get(q, k);
    const where = state.layer === "rollout" ? "rollout"
      : "layer " + v.layers[state.layer] + ", " + headName(item);
    return "query " + q + " " + JSON.stringify(v.query_tokens[q]) + " -> key " + k + " " +
      JSON.stringify(v.key_tokens[k]) + ": " +
      (w > 0 ? "weight " + w.toFixed(3) : "below " + META.threshold + " (not stored)") +
      " (" + where + ")";
  }

  function drawMatrix() {
    const v = view(), item = matrixItem();
    const tools = html("div", { id: "matrix-tools" }, stage);
    const button = (id, text, fn) => html("button", { id: id }, tools, text)
      .addEventListener("click", () => { fn(); clampZoom(v); paintMatrix(canvas); });
    const centre = () => [zoom.x + MATRIX.size / cellSize(v) / 2,
                          zoom.y + MATRIX.size / cellSize(v) / 2];
    const zoomAt = (factor, cx, cy) => {
      const before = cellSize(v);
      zoom.scale = Math.max(1, Math.min(zoom.scale * factor, Math.max(
        v.query_tokens.length, v.key_tokens.length) / 4));
      const after = cellSize(v);
      zoom.x = cx - (cx - zoom.x) * before / after;
      zoom.y = cy - (cy - zoom.y) * before / after;
    };
    button("zoom-in", "zoom in", () => zoomAt(2, ...centre()));
    button("zoom-out", "zoom out", () => zoomAt(0.5, ...centre()));
    button("zoom-reset", "reset", () => { zoom.scale = 1; zoom.x = 0; zoom.y = 0; });
    html("span", {}, tools, " wheel: zoom, drag: pan, click: choose the pair for the " +
         "neuron view; colour: \u221Aweight" + (item.head === "mean" ? "; mean over heads" : ""));
    const canvas = html("canvas", { id: "matrix", width: MATRIX.left + MATRIX.size + 10,
                                    height: MATRIX.top + MATRIX.size + 10 }, stage);
    const at = (event) => {
      const r = canvas.getBoundingClientRect(), size = cellSize(v);
      const q = Math.floor(zoom.y + (event.clientY - r.top - MATRIX.top) / size);
      const k = Math.floor(zoom.x + (event.clientX - r.left - MATRIX.left) / size);
      const inside = q >= 0 && k >= 0 && q < v.query_tokens.length && k < v.key_tokens.length &&
        event.clientX - r.left >= MATRIX.left && event.clientY - r.top >= MATRIX.top;
      return inside ? { q: q, k: k, x: event.clientX, y: event.clientY } : null;
    };
    let drag = null, frame = 0;
    const repaint = () => { if (!frame) frame = requestAnimationFrame(() => {
      frame = 0; paintMatrix(canvas); }); };
    canvas.addEventListener("mousedown", (e) => { drag = { x: e.clientX, y: e.clientY,
      zx: zoom.x, zy: zoom.y, moved: false }; });
    window.addEventListener("mouseup", () => { setTimeout(() => { drag = null; }, 0); });
    canvas.addEventListener("mousemove", (e) => {
      if (drag && (Math.abs(e.clientX - drag.x) + Math.abs(e.clientY - drag.y) > 3)) {
        drag.moved = true;
        zoom.x = drag.zx - (e.clientX - drag.x) / cellSize(v);
        zoom.y = drag.zy - (e.clientY - drag.y) / cellSize(v);
        clampZoom(v);
      }
      const found = at(e);
      cell = found;
      if (found) {
        canvas.dataset.q = found.q; canvas.dataset.k = found.k;
        canvas.dataset.weight = item.rows.get(found.q, found.k).toFixed(4);
        document.getElementById("info").textContent = describeCell(v, item, found.q, found.k);
      }
      repaint();
    });
    canvas.addEventListener("mouseleave", () => { cell = null; repaint(); });
    canvas.addEventListener("click", (e) => {
      const found = at(e);
      if (!found || (drag && drag.moved)) return;
      choosePair(found.q, found.k);
      document.getElementById("info").textContent = "chosen: " +
        describeCell(v, item, found.q, found.k);
      repaint();
    });
    canvas.addEventListener("wheel", (e) => {
      const found = at(e);
      if (!found) return;
      e.preventDefault();
      zoomAt(e.deltaY < 0 ? 1.25 : 0.8, found.k, found.q);
      clampZoom(v);
      repaint();
    }, { passive: false });
    canvas.addEventListener("dblclick", () => { zoom.scale = 1; zoom.x = 0; zoom.y = 0;
      repaint(); });
    clampZoom(v);
    paintMatrix(canvas);
  }

  function choosePair(q, k) {
    state.pair = { q: q, k: k };
    state.start = Math.max(0, q - LINE_LIMIT / 2);
    const v = view();
    document.getElementById("pair").textContent = "pair: " + JSON.stringify(v.query_tokens[q]) +
      " (" + q + ") -> " + JSON.stringify(v.key_tokens[k]) + " (" + k + ")";
  }

  function drawModel() {
    const v = view(), nq = v.query_tokens.length, nk = v.key_tokens.length, t = MATRIX.thumb;
    const grid = html("div", { id: "model-grid" }, stage);
    grid.style.gridTemplateColumns = "auto repeat(" + v.heads.length + ", " + (t + 4) + "px)";
    html("span", {}, grid, "");
    v.heads.forEach((h) => html("span", {}, grid, "head " + h));
    const current = state.layer === "rollout" ? -1 : state.layer;
    v.layers.forEach((layer, li) => {
      html("span", {}, grid, "layer " + layer);
      v.heads.forEach((head, hi) => {
        const rows = headRows(state.view, li, hi);
        const thumb = html("canvas", { class: "thumb" + (li === current &&
          String(hi) === state.head ? " current" : "") + (rows ? "" : " no-map"), width: t,
          height: t, "data-layer": li, "data-head": hi, title: "layer " + layer + ", head " +
          head + (rows ? "" : ": per-row summaries only") }, grid);
        if (rows) {  // a head without a map on the page stays blank
          const image = cached(state.view + "/" + li + "/" + hi + "/thumb", () => paintRows(
            rows, nq, nk, Math.min(t, nk), Math.min(t, nq), Math.max));
          const ctx = thumb.getContext("2d");
          ctx.imageSmoothingEnabled = false;
          ctx.drawImage(image, 0, 0, t, t);
        }
        thumb.addEventListener("click", () => {
          select(li, hi);
          state.display = rows ? "matrix" : "rows";
          pick.display.value = state.display;
          draw();
        });
      });
    });
    document.getElementById("info").textContent =
      "every layer x head; click one to open it in the matrix view";
  }

  DISPLAYS.matrix = { label: "matrix view (heatmap)", draw: drawMatrix, available: () => true };
  DISPLAYS.model = { label: "model view (every layer x head)", draw: drawModel,
                     available: () => true, withoutMaps: true };
