
  const META = JSON.parse(document.getElementById("qkv-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const LINE_LIMIT = 160;  // the head view draws at most this many tokens at once
  const TYPED = { u8: Uint8Array, u16: Uint16Array, u32: Uint32Array, f32: Float32Array };
  const stage = document.getElementById("stage");
  const pick = {
    view: document.getElementById("view"),
    layer: document.getElementById("layer"),
    head: document.getElementById("head"),
    display: document.getElementById("display"),
  };
  const state = { view: 0, layer: 0, head: "0", display: "lines", hover: null, pair: null,
                  start: 0 };
  const DISPLAYS = {};  // name -> { label, draw(), available(view) }
  let ARRAYS = null;
  let svg = null;

  async function inflate(text) {
    const response = await fetch("data:application/octet-stream;base64," + text.trim());
    const stream = response.body.pipeThrough(new DecompressionStream("gzip"));
    return new Response(stream).arrayBuffer();
  }
  function arrayOf(ref) { return new TYPED[ref[0]](ARRAYS, ref[1], ref[2]); }

  // One head's stored rows: keys at or above the threshold, one byte per weight.
  class Rows {
    constructor(ref, nq) {
      const counts = arrayOf(ref.counts), deltas = arrayOf(ref.cols);
      this.values = arrayOf(ref.values);
      this.dropped = arrayOf(ref.dropped);
      this.starts = new Uint32Array(nq + 1);
      this.cols = new Int32Array(deltas.length);
      let j = 0;
      for (let q = 0; q < nq; q++) {
        this.starts[q] = j;
        let col = 0;
        for (let c = 0; c < counts[q]; c++, j++) { col = c === 0 ? deltas[j] : col + deltas[j];
          this.cols[j] = col; }
      }
      this.starts[nq] = j;
      this.nq = nq;
      this.leftOut = ref.left_out;
    }
    row(q, fn) {
      for (let j = this.starts[q]; j < this.starts[q + 1]; j++) {
        fn(this.cols[j], this.values[j] / META.levels, j);
      }
    }
    get(q, k) {
      let lo = this.starts[q], hi = this.starts[q + 1];
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (this.cols[mid] < k) lo = mid + 1; else hi = mid;
      }
      return lo < this.starts[q + 1] && this.cols[lo] === k ? this.values[lo] / META.levels : 0;
    }
    index(q, k) {  // the position of (q, k) among the stored entries, or -1
      for (let j = this.starts[q]; j < this.starts[q + 1]; j++) if (this.cols[j] === k) return j;
      return -1;
    }
    forEach(fn) { for (let q = 0; q < this.nq; q++) this.row(q, (k, w) => fn(q, k, w)); }
  }
  // The mean over a layer's heads, kept dense (Nq x Nk floats).
  class MeanRows {
    constructor(heads, nq, nk) {
      this.nq = nq; this.nk = nk;
      this.dense = new Float32Array(nq * nk);
      const count = heads.length;
      for (const h of heads) h.forEach((q, k, w) => { this.dense[q * nk + k] += w / count; });
      this.leftOut = [0, 1].map((i) => heads.reduce((s, h) => s + h.leftOut[i], 0) / count);
    }
    row(q, fn) {
      for (let k = 0; k < this.nk; k++) {
        const w = this.dense[q * this.nk + k];
        if (w >= META.threshold) fn(k, w, -1);
      }
    }
    get(q, k) { return this.dense[q * this.nk + k]; }
    index() { return -1; }
    forEach(fn) { for (let q = 0; q < this.nq; q++) this.row(q, (k, w) => fn(q, k, w)); }
  }
  const cache = new Map();
  function cached(key, make) {
    if (!cache.has(key)) cache.set(key, make());
    return cache.get(key);
  }
  // A long input's page maps the chosen heads only: the others' maps are null.
  function headRows(vi, li, hi) {
    const v = META.views[vi];
    if (!v.maps[li][hi]) return null;
    return cached(vi + "/" + li + "/" + hi, () => new Rows(v.maps[li][hi], v.query_tokens.length));
  }
  function mappedHeads(v, li) { return v.heads.map((_, h) => h).filter((h) => v.maps[li][h]); }
  // Mean maps are dense (Nq x Nk floats): keep the newest few.
  const means = new Map();
  function meanRows(vi, li) {
    const v = META.views[vi], key = vi + "/" + li;
    if (!means.has(key)) {
      if (means.size >= 4) means.delete(means.keys().next().value);
      means.set(key, new MeanRows(mappedHeads(v, li).map((h) => headRows(vi, li, h)),
                                  v.query_tokens.length, v.key_tokens.length));
    }
    return means.get(key);
  }

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function html(name, attrs, parent, text) {
    const node = document.createElement(name);
    for (const key in attrs) node.setAttribute(key, attrs[key]);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function option(select, value, text) {
    html("option", { value: String(value) }, select, text);
  }
  function view() { return META.views[state.view]; }
  function headColor(h, count) {
    return "hsl(" + Math.round((360 * h) / Math.max(1, count)) + ", 70%, 42%)";
  }
  function headName(item) {
    return item.head === "rollout" ? "rollout" : item.head === "mean" ? "mean over heads"
      : "head " + item.head;
  }
  function newSvg(width, height) {
    svg = el("svg", { id: "canvas", width: width, height: height }, stage);
    return svg;
  }

  // The maps on screen: [{head, color, rows}] for the chosen layer and head, those the page
  // holds (none for a head it keeps summaries of only).
  function matrices() {
    const v = view();
    if (state.layer === "rollout") {
      const rows = cached(state.view + "/rollout",
                          () => new Rows(v.rollout, v.query_tokens.length));
      return [{ head: "rollout", color: "#6c3483", rows: rows }];
    }
    const count = v.heads.length, mapped = mappedHeads(v, state.layer);
    if (state.head === "mean") {
      return mapped.length ? [{ head: "mean", color: "#6c3483",
                                rows: meanRows(state.view, state.layer) }] : [];
    }
    if (state.head === "all") {
      return mapped.map((i) => ({ head: v.heads[i], color: headColor(i, count),
                                  rows: headRows(state.view, state.layer, i) }));
    }
    const i = Number(state.head);
    return v.maps[state.layer][i] ? [{ head: v.heads[i], color: headColor(i, count),
                                       rows: headRows(state.view, state.layer, i) }] : [];
  }

  function fillControls() {
    META.views.forEach((v, i) => option(pick.view, i, v.name));
    fillDisplays();
    fillLayerHead();
  }
  function fillDisplays() {
    pick.display.innerHTML = "";
    for (const name in DISPLAYS) {
      if (DISPLAYS[name].available(view())) option(pick.display, name, DISPLAYS[name].label);
    }
    if (!DISPLAYS[state.display].available(view())) state.display = "matrix";
    pick.display.value = state.display;
  }
  function fillLayerHead() {
    const v = view();
    pick.layer.innerHTML = "";
    pick.head.innerHTML = "";
    v.layers.forEach((layer, i) => option(pick.layer, i, "layer " + layer));
    if (v.rollout) option(pick.layer, "rollout", "rollout (all layers)");
    v.heads.forEach((head, i) => option(pick.head, i, "head " + head));
    option(pick.head, "mean", "mean over heads");
    option(pick.head, "all", "all heads (colour per head)");
    select(0, "0");
  }
  function select(layer, head) {
    state.layer = layer;
    state.head = String(head);
    pick.layer.value = String(layer);
    pick.head.value = String(head);
  }
  function tokenClass(v, side, index) {
    const generated = v.first_generated !== null && index >= v.first_generated &&
      (v.kind !== "cross" || side === "q");
    return "token" + (generated ? " generated" : "");
  }

  function legend() {
    const box = document.getElementById("legend");
    box.innerHTML = "";
    const v = view(), [a, b] = shownRange(v);
    const n = Math.max(v.query_tokens.length, v.key_tokens.length);
    let note = "";
    if (state.display === "image") {
      note = "patch tint: attention the patch receives (mean over the heads shown). ";
    } else if (state.display === "lines" || state.display === "graph") {
      note = (state.display === "graph" ? "arrows: query -> the key it attends to; " : "") +
        "edges below weight " + META.threshold + " are not drawn. " +
        (b - a < n ? "tokens " + a + "-" + (b - 1) + " of " + n +
          " (click a cell in the matrix view, or start at token " : "");
    }
    html("span", {}, box, note);
    if (note.endsWith("start at token ")) {
      const start = html("input", { id: "window-start", type: "number", min: 0, max: n - 1,
                                    value: a }, box);
      start.style.width = "70px";
      start.addEventListener("change", () => { state.start = Number(start.value); draw(); });
      html("span", {}, box, "). ");
    }
    if (state.display === "lines" || state.display === "graph" || state.display === "image") {
      for (const item of matrices()) {
        const s = html("span", { class: "swatch" }, box, "\u25A0 " + headName(item) + " ");
        s.style.color = item.color;
      }
    }
    if (v.first_generated !== null) {
      html("span", { class: "generated-note" }, box, " purple italic: generated tokens.");
    }
  }

  // What the page leaves out, for the maps on screen, and what the page says it leaves out.
  function omitted() {
    const shown = matrices(), v = view();
    const mean = shown.reduce((s, m) => s + m.rows.leftOut[0], 0) / shown.length;
    const worst = Math.max(...shown.map((m) => m.rows.leftOut[1]));
    const stored = "Stored: weights of at least " + META.threshold +
      (META.max_per_row ? ", at most " + META.max_per_row + " per query," : "") +
      " to 1/" + META.levels + ". ";
    document.getElementById("omitted").textContent = (shown.length ? stored +
      "Left out here: " + (100 * mean).toFixed(2) + "% of a query's attention on average, " +
      (100 * worst).toFixed(2) + "% at most." : "The page holds no map of the head(s) " +
      "chosen here.") +
      (v.neurons.length && v.neurons.length < v.layers.length ? " Neuron view: q and k kept " +
        "for " + v.neurons.map((n) => "layer " + v.layers[n.layer]).join(", ") + " only." : "") +
      (v.omitted.length ? " " + v.omitted.join(" ") : "");
  }
  // Where a display needs maps the page does not hold for the chosen head: say so.
  function noMap() {
    const v = view(), names = mappedHeads(v, state.layer).map((h) => v.heads[h]);
    html("div", { id: "no-map" }, stage, "Layer " + v.layers[state.layer] + (isFinite(
      Number(state.head)) ? ", head " + v.heads[Number(state.head)] : "") + ": the page " +
      "holds this head's per-row summaries (show: per-row summaries), not its map. " +
      (names.length ? "Heads with maps in this layer: " + names.join(", ") + "."
        : "This layer has no head with a map."));
    document.getElementById("info").textContent = "";
  }

  function draw() {
    stage.innerHTML = "";
    svg = null;
    if (DISPLAYS[state.display].withoutMaps || state.layer === "rollout" || matrices().length) {
      DISPLAYS[state.display].draw();
    } else {
      noMap();
    }
    legend();
    omitted();
    applyHover();
    document.body.dataset.layer = String(state.layer);
    document.body.dataset.head = String(state.head);
    document.body.dataset.display = state.display;
  }

