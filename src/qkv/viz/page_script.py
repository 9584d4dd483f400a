"""The interactive page's script and style, inlined into every page (no CDN, works offline).

The script is one async function made of parts that share its scope: this file's core
(data, controls, the head view as lines or a graph, the ViT patches), ``page_matrix`` (the
matrix view and the model view, on canvas) and ``page_panels`` (the neuron view and the head
summary). It reads the JSON block ``#qkv-data`` and the gzip-compressed arrays
``#qkv-arrays`` written by ``qkv.viz.page``. Drawn edges carry ``data-q``, ``data-k``,
``data-head`` and ``data-weight`` (the weight shown), so a browser test can read back what is
on screen; the other views expose the same through ``data-*`` attributes."""

from .page_matrix import MATRIX_SCRIPT, MATRIX_STYLE
from .page_panels import PANELS_SCRIPT, PANELS_STYLE

STYLE = r"""
body { font-family: sans-serif; margin: 12px; color: #222; background: #fff; }
#controls { display: flex; gap: 14px; flex-wrap: wrap; align-items: center; margin-bottom: 8px; }
#controls label { font-size: 13px; }
#legend, #omitted { font-size: 12px; margin: 4px 0; min-height: 16px; }
#omitted { color: #666; }
#info { font-size: 12px; min-height: 32px; white-space: pre-wrap; font-family: monospace; }
svg { border: 1px solid #ddd; background: #fcfcfc; }
.token { font-size: 13px; cursor: pointer; fill: #222; }
.token.generated { fill: #7d3c98; font-style: italic; }
.token.attended { fill: #c0392b; font-weight: bold; }
.token.attending { fill: #1f6fb2; font-weight: bold; }
.token.hovered { fill: #000; font-weight: bold; text-decoration: underline; }
.edge { fill: none; }
.edge.dim { stroke-opacity: 0.04 !important; }
.edge.out { stroke: #c0392b !important; }
.edge.in { stroke: #1f6fb2 !important; }
.node { stroke: #555; fill: #fff; cursor: pointer; }
.node.attended { fill: #f5b7b1; }
.node.attending { fill: #aed6f1; }
.patch { stroke: #888; stroke-width: 0.5; cursor: pointer; }
.patch.hovered { stroke: #1f6fb2; stroke-width: 2; }
""" + MATRIX_STYLE + PANELS_STYLE

CORE_SCRIPT = r"""
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
  function headRows(vi, li, hi) {
    const v = META.views[vi];
    return cached(vi + "/" + li + "/" + hi, () => new Rows(v.maps[li][hi], v.query_tokens.length));
  }
  function meanRows(vi, li) {
    const v = META.views[vi];
    return cached(vi + "/" + li + "/mean", () => new MeanRows(
      v.heads.map((_, h) => headRows(vi, li, h)), v.query_tokens.length, v.key_tokens.length));
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

  // The maps on screen: [{head, color, rows}] for the chosen layer and head.
  function matrices() {
    const v = view();
    if (state.layer === "rollout") {
      const rows = cached(state.view + "/rollout",
                          () => new Rows(v.rollout, v.query_tokens.length));
      return [{ head: "rollout", color: "#6c3483", rows: rows }];
    }
    const count = v.heads.length;
    if (state.head === "mean") {
      return [{ head: "mean", color: "#6c3483", rows: meanRows(state.view, state.layer) }];
    }
    if (state.head === "all") {
      return v.heads.map((head, i) => ({ head: head, color: headColor(i, count),
                                         rows: headRows(state.view, state.layer, i) }));
    }
    const i = Number(state.head);
    return [{ head: v.heads[i], color: headColor(i, count),
              rows: headRows(state.view, state.layer, i) }];
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

  // The head view's tokens: all of them, or a window of LINE_LIMIT around the chosen pair.
  function shownRange(v) {
    const n = Math.max(v.query_tokens.length, v.key_tokens.length);
    if (n <= LINE_LIMIT) return [0, n];
    const start = Math.max(0, Math.min(state.start, n - LINE_LIMIT));
    return [start, start + LINE_LIMIT];
  }
  function edgeAttrs(q, k, head, w, color) {
    return {
      class: "edge", "data-q": q, "data-k": k, "data-head": head,
      "data-weight": w.toFixed(4), stroke: color,
      "stroke-opacity": Math.min(1, 0.15 + w).toFixed(3),
      "stroke-width": (0.5 + 4 * w).toFixed(2),
    };
  }
  function eachEdge(fn) {
    const [a, b] = shownRange(view());
    for (const item of matrices()) {
      for (let q = a; q < Math.min(b, view().query_tokens.length); q++) {
        item.rows.row(q, (k, w) => { if (k >= a && k < b) fn(q, k, item.head, w, item.color); });
      }
    }
  }

  function drawLines() {
    const v = view(), [a, b] = shownRange(v);
    const rows = b - a;
    const step = 22, top = 30, left = 150, right = 520;
    newSvg(680, top + rows * step + 20);
    el("text", { x: left, y: 16, "text-anchor": "end", class: "heading" }, svg)
      .textContent = "query";
    el("text", { x: right, y: 16, class: "heading" }, svg).textContent = "key";
    const y = (i) => top + (i - a) * step;
    const edges = el("g", { id: "edges" }, svg);
    eachEdge((q, k, head, w, color) => {
      el("line", Object.assign(edgeAttrs(q, k, head, w, color),
        { x1: left + 6, y1: y(q) - 4, x2: right - 6, y2: y(k) - 4 }), edges);
    });
    for (let i = a; i < Math.min(b, v.query_tokens.length); i++) {
      token(v, v.query_tokens[i], "q", i, left - 2, y(i), "end");
    }
    for (let i = a; i < Math.min(b, v.key_tokens.length); i++) {
      token(v, v.key_tokens[i], "k", i, right + 2, y(i), "start");
    }
  }
  function token(v, text, side, index, x, y, anchor) {
    const node = el("text", {
      class: tokenClass(v, side, index), "data-side": side, "data-index": index, x: x, y: y,
      "text-anchor": anchor,
    }, svg);
    node.textContent = text;
    node.addEventListener("mouseenter", () => hover(side, index));
    node.addEventListener("mouseleave", () => hover(null, null));
  }

  function drawGraph() {
    const v = view(), [a, b] = shownRange(v);
    const cross = v.kind === "cross";
    const span = (list, side) => list.slice(a, b).map((t, i) => ({ text: t, side: side,
                                                                     index: a + i }));
    // Cross-attention: keys (source) on the left half, queries (target) on the right half.
    const nodes = cross ? span(v.key_tokens, "k").concat(span(v.query_tokens, "q"))
      : span(v.query_tokens, "q");
    const size = 600, c = size / 2, r = size / 2 - 90;
    newSvg(size, size);
    const defs = el("defs", {}, svg);
    // Fixed-size arrowheads: the default (strokeWidth units) would grow with the weight.
    const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5,
      markerUnits: "userSpaceOnUse", markerWidth: 7, markerHeight: 7,
      orient: "auto-start-reverse" }, defs);
    el("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#555" }, marker);
    const pos = nodes.map((n, i) => {
      const angle = (2 * Math.PI * i) / nodes.length - Math.PI / 2;
      return { x: c + r * Math.cos(angle), y: c + r * Math.sin(angle), a: angle };
    });
    const find = (side, index) => nodes.findIndex(
      (n) => n.index === index && (n.side === side || !cross));
    const edges = el("g", { id: "edges" }, svg);
    eachEdge((q, k, head, w, color) => {
      const p = pos[find("q", q)], s = pos[find("k", k)];
      let d;
      if (p === s) {  // a token attending to itself: a small loop outside the circle
        const ox = 18 * Math.cos(p.a), oy = 18 * Math.sin(p.a);
        d = "M " + p.x + " " + p.y + " c " + (ox - oy) + " " + (oy + ox) + " " +
          (ox + oy) + " " + (oy - ox) + " 0 0";
      } else {  // bend towards the centre so opposite edges stay apart
        const mx = (p.x + s.x) / 2 * 0.7 + c * 0.3, my = (p.y + s.y) / 2 * 0.7 + c * 0.3;
        d = "M " + p.x + " " + p.y + " Q " + mx + " " + my + " " + s.x + " " + s.y;
      }
      el("path", Object.assign(edgeAttrs(q, k, head, w, color),
        { d: d, "marker-end": "url(#arrow)" }), edges);
    });
    nodes.forEach((n, i) => {
      const p = pos[i];
      const circle = el("circle", { class: "node", cx: p.x, cy: p.y, r: 5,
        "data-side": n.side, "data-index": n.index }, svg);
      circle.addEventListener("mouseenter", () => hover(n.side, n.index));
      circle.addEventListener("mouseleave", () => hover(null, null));
      const tx = c + (r + 14) * Math.cos(p.a), ty = c + (r + 14) * Math.sin(p.a) + 4;
      token(v, n.text, n.side, n.index, tx, ty, Math.cos(p.a) < -0.1 ? "end" : "start");
    });
  }

  function drawImage() {
    const img = META.image, v = view();
    const h = img.pixels.length, w = img.pixels[0].length, scale = Math.floor(360 / w);
    newSvg(w * scale + 20, h * scale + 20);
    const g = el("g", { transform: "translate(10, 10)" }, svg);
    img.pixels.forEach((row, y) => row.forEach((p, x) => {
      const rgb = Array.isArray(p) ? p : [p, p, p];
      const css = "rgb(" + rgb.map((c) => Math.round(255 * c)).join(",") + ")";
      el("rect", { x: x * scale, y: y * scale, width: scale, height: scale, fill: css }, g);
    }));
    const [gh, gw] = img.grid, ph = (h / gh) * scale, pw = (w / gw) * scale;
    const source = state.hover && state.hover.side === "q" ? state.hover.index : 0;
    const shown = matrices();
    const offset = img.cls ? 1 : 0;
    for (let i = 0; i < gh * gw; i++) {
      const k = i + offset;
      const wsum = shown.reduce((s, m) => s + m.rows.get(source, k), 0) / shown.length;
      const rect = el("rect", {
        class: "patch" + (k === source ? " hovered" : ""), x: (i % gw) * pw,
        y: Math.floor(i / gw) * ph, width: pw, height: ph, fill: "#e67e22",
        "fill-opacity": Math.min(0.85, 3 * wsum).toFixed(3), "data-index": k,
        "data-weight": wsum.toFixed(4),
      }, g);
      rect.addEventListener("mouseenter", () => {
        if (state.hover && state.hover.index === k) return;  // redrawing fires it again
        state.hover = { side: "q", index: k };
        draw();
      });
    }
    document.getElementById("info").textContent = "attention from " +
      v.query_tokens[source] + " to each patch (hover a patch to move it)";
  }

  function hover(side, index) {
    state.hover = side === null ? null : { side: side, index: index };
    applyHover();
  }
  function applyHover() {
    if (state.display !== "lines" && state.display !== "graph") return;
    const v = view(), hv = state.hover, selfAttn = v.kind !== "cross";
    const outs = [], ins = [];
    document.querySelectorAll(".edge").forEach((e) => {
      e.classList.remove("dim", "out", "in");
      if (!hv) return;
      const q = Number(e.dataset.q), k = Number(e.dataset.k), head = e.dataset.head;
      const isOut = q === hv.index && (selfAttn || hv.side === "q");
      const isIn = k === hv.index && (selfAttn || hv.side === "k");
      if (isOut) { e.classList.add("out"); outs.push([k, Number(e.dataset.weight), head]); }
      else if (isIn) { e.classList.add("in"); ins.push([q, Number(e.dataset.weight), head]); }
      else e.classList.add("dim");
    });
    document.querySelectorAll(".token, .node").forEach((t) => {
      t.classList.remove("attended", "attending", "hovered");
      if (!hv) return;
      const i = Number(t.dataset.index), side = t.dataset.side;
      const same = side === hv.side || selfAttn;
      if (same && i === hv.index && t.classList.contains("token")) t.classList.add("hovered");
      if (outs.some(([k]) => k === i) && (side === "k" || (selfAttn && side === "q" &&
          state.display === "graph"))) t.classList.add("attended");
      if (ins.some(([q]) => q === i) && (side === "q" || (selfAttn && state.display === "graph")))
        t.classList.add("attending");
    });
    // With several heads on screen, each weight says which head it comes from.
    const several = state.head === "all" && state.layer !== "rollout";
    const name = (list, i) => JSON.stringify(list[i]);
    const fmt = (pairs, list) => pairs.sort((a, b) => b[1] - a[1]).slice(0, 8)
      .map(([i, w, head]) => name(list, i) + " " + w.toFixed(3) +
        (several ? " (head " + head + ")" : "")).join(", ");
    const tokens = hv && (hv.side === "q" ? v.query_tokens : v.key_tokens);
    document.getElementById("info").textContent = hv
      ? name(tokens, hv.index) + " attends to: " + (fmt(outs, v.key_tokens) || "-") +
        "\n" + name(tokens, hv.index) + " is attended by: " + (fmt(ins, v.query_tokens) || "-")
      : "hover a token";
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
          " (click a cell in the matrix view to move). " : "");
    }
    html("span", {}, box, note);
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

  // What the page leaves out, for the maps on screen.
  function omitted() {
    const shown = state.layer === "rollout" || !isFinite(Number(state.head))
      ? matrices() : matrices().slice(0, 1);
    const mean = shown.reduce((s, m) => s + m.rows.leftOut[0], 0) / shown.length;
    const worst = Math.max(...shown.map((m) => m.rows.leftOut[1]));
    document.getElementById("omitted").textContent =
      "Stored: weights of at least " + META.threshold +
      (META.max_per_row ? ", at most " + META.max_per_row + " per query," : "") +
      " to 1/" + META.levels + ". Left out here: " + (100 * mean).toFixed(2) +
      "% of a query's attention on average, " + (100 * worst).toFixed(2) + "% at most.";
  }

  function draw() {
    stage.innerHTML = "";
    svg = null;
    DISPLAYS[state.display].draw();
    legend();
    omitted();
    applyHover();
    document.body.dataset.layer = String(state.layer);
    document.body.dataset.head = String(state.head);
    document.body.dataset.display = state.display;
  }

  DISPLAYS.lines = { label: "head view: lines between tokens", draw: drawLines,
                     available: () => true };
  DISPLAYS.graph = { label: "graph of the layer", draw: drawGraph, available: () => true };
  if (META.image) {
    DISPLAYS.image = { label: "patches on the image", draw: drawImage, available: () => true };
  }
"""

MAIN_SCRIPT = r"""
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
  ARRAYS = await inflate(document.getElementById("qkv-arrays").textContent);
  const longest = Math.max(...META.views.map((v) => v.query_tokens.length));
  state.display = META.image ? "image" : longest > LINE_LIMIT ? "matrix" : "lines";
  fillControls();
  draw();
  // Milliseconds from navigation to the first view drawn (the viz benchmark reads it).
  document.body.dataset.readyMs = String(Math.round(performance.now()));
  document.body.dataset.ready = "1";
"""

SCRIPT = ("\n(async function () {\n  \"use strict\";\n" + CORE_SCRIPT + MATRIX_SCRIPT
          + PANELS_SCRIPT + MAIN_SCRIPT + "})();\n")
