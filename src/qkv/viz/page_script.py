"""The interactive page's script and style, inlined into every page (no CDN, works offline).

The script reads the JSON block ``#qkv-data`` written by ``qkv.viz.page`` and draws SVG.
Every drawn edge carries ``data-q``, ``data-k``, ``data-head`` and ``data-weight`` (the weight
it shows), so a browser test can read back exactly what is on screen."""

STYLE = r"""
body { font-family: sans-serif; margin: 12px; color: #222; background: #fff; }
#controls { display: flex; gap: 14px; flex-wrap: wrap; align-items: center; margin-bottom: 8px; }
#controls label { font-size: 13px; }
#legend { font-size: 12px; margin: 4px 0; min-height: 16px; }
#info { font-size: 12px; min-height: 32px; white-space: pre-wrap; font-family: monospace; }
svg { border: 1px solid #ddd; background: #fcfcfc; }
.token { font-size: 13px; cursor: pointer; fill: #222; }
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
"""

SCRIPT = r"""
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("qkv-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";
  const svg = document.getElementById("canvas");
  const pick = {
    view: document.getElementById("view"),
    layer: document.getElementById("layer"),
    head: document.getElementById("head"),
    display: document.getElementById("display"),
  };
  const state = { view: 0, layer: 0, head: "0", display: "lines", hover: null };

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function option(select, value, text) {
    const o = document.createElement("option");
    o.value = String(value);
    o.textContent = text;
    select.appendChild(o);
  }
  function view() { return DATA.views[state.view]; }
  // Whitespace tokens would be invisible: show space, newline and tab as symbols.
  function visible(text) {
    return text.replace(/ /g, "\u2423").replace(/\n/g, "\u23CE").replace(/\t/g, "\u21E5");
  }
  function headColor(h, count) {
    return "hsl(" + Math.round((360 * h) / Math.max(1, count)) + ", 70%, 42%)";
  }

  // The matrices on screen: [{head, color, matrix}] for the chosen layer and head.
  function matrices() {
    const v = view();
    if (state.layer === "rollout") {
      return [{ head: "rollout", color: "#6c3483", matrix: v.rollout }];
    }
    const perHead = v.weights[state.layer];
    const count = v.heads.length;
    if (state.head === "all") {
      return perHead.map((m, i) => ({ head: v.heads[i], color: headColor(i, count), matrix: m }));
    }
    const i = Number(state.head);
    return [{ head: v.heads[i], color: headColor(i, count), matrix: perHead[i] }];
  }

  function fillControls() {
    DATA.views.forEach((v, i) => option(pick.view, i, v.name));
    const displays = [["lines", "lines between tokens"], ["graph", "graph of the layer"]];
    if (DATA.image) displays.push(["image", "patches on the image"]);
    displays.forEach(([value, text]) => option(pick.display, value, text));
    fillLayerHead();
  }
  function fillLayerHead() {
    const v = view();
    pick.layer.innerHTML = "";
    pick.head.innerHTML = "";
    v.layers.forEach((layer, i) => option(pick.layer, i, "layer " + layer));
    if (v.rollout) option(pick.layer, "rollout", "rollout (all layers)");
    v.heads.forEach((head, i) => option(pick.head, i, "head " + head));
    option(pick.head, "all", "all heads (colour per head)");
    state.layer = 0;
    state.head = "0";
    pick.layer.value = "0";
    pick.head.value = "0";
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
    for (const item of matrices()) {
      item.matrix.forEach((row, q) => row.forEach((w, k) => {
        if (w >= DATA.threshold) fn(q, k, item.head, w, item.color);
      }));
    }
  }

  function drawLines() {
    const v = view();
    const rows = Math.max(v.query_tokens.length, v.key_tokens.length);
    const step = 22, top = 30, left = 150, right = 520;
    svg.setAttribute("width", 680);
    svg.setAttribute("height", top + rows * step + 20);
    el("text", { x: left, y: 16, "text-anchor": "end", class: "heading" }, svg)
      .textContent = "query";
    el("text", { x: right, y: 16, class: "heading" }, svg).textContent = "key";
    const y = (i) => top + i * step;
    const edges = el("g", { id: "edges" }, svg);
    eachEdge((q, k, head, w, color) => {
      el("line", Object.assign(edgeAttrs(q, k, head, w, color),
        { x1: left + 6, y1: y(q) - 4, x2: right - 6, y2: y(k) - 4 }), edges);
    });
    v.query_tokens.forEach((t, i) => token(t, "q", i, left - 2, y(i), "end"));
    v.key_tokens.forEach((t, i) => token(t, "k", i, right + 2, y(i), "start"));
  }
  function token(text, side, index, x, y, anchor) {
    const node = el("text", {
      class: "token", "data-side": side, "data-index": index, x: x, y: y,
      "text-anchor": anchor,
    }, svg);
    node.textContent = visible(text);
    node.addEventListener("mouseenter", () => hover(side, index));
    node.addEventListener("mouseleave", () => hover(null, null));
  }

  function drawGraph() {
    const v = view();
    const cross = v.kind === "cross";
    // Cross-attention: keys (source) on the left half, queries (target) on the right half.
    const nodes = cross
      ? v.key_tokens.map((t, i) => ({ text: t, side: "k", index: i }))
        .concat(v.query_tokens.map((t, i) => ({ text: t, side: "q", index: i })))
      : v.query_tokens.map((t, i) => ({ text: t, side: "q", index: i }));
    const size = 600, c = size / 2, r = size / 2 - 90;
    svg.setAttribute("width", size);
    svg.setAttribute("height", size);
    const defs = el("defs", {}, svg);
    // Fixed-size arrowheads: the default (strokeWidth units) would grow with the weight.
    const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5,
      markerUnits: "userSpaceOnUse", markerWidth: 7, markerHeight: 7,
      orient: "auto-start-reverse" }, defs);
    el("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#555" }, marker);
    const pos = nodes.map((n, i) => {
      const a = (2 * Math.PI * i) / nodes.length - Math.PI / 2;
      return { x: c + r * Math.cos(a), y: c + r * Math.sin(a), a: a };
    });
    const find = (side, index) => nodes.findIndex(
      (n) => n.index === index && (n.side === side || !cross));
    const edges = el("g", { id: "edges" }, svg);
    eachEdge((q, k, head, w, color) => {
      const a = pos[find("q", q)], b = pos[find("k", k)];
      let d;
      if (a === b) {  // a token attending to itself: a small loop outside the circle
        const ox = 18 * Math.cos(a.a), oy = 18 * Math.sin(a.a);
        d = "M " + a.x + " " + a.y + " c " + (ox - oy) + " " + (oy + ox) + " " +
          (ox + oy) + " " + (oy - ox) + " 0 0";
      } else {  // bend towards the centre so opposite edges stay apart
        const mx = (a.x + b.x) / 2 * 0.7 + c * 0.3, my = (a.y + b.y) / 2 * 0.7 + c * 0.3;
        d = "M " + a.x + " " + a.y + " Q " + mx + " " + my + " " + b.x + " " + b.y;
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
      token(n.text, n.side, n.index, tx, ty, Math.cos(p.a) < -0.1 ? "end" : "start");
    });
  }

  function drawImage() {
    const img = DATA.image, v = view();
    const h = img.pixels.length, w = img.pixels[0].length, scale = Math.floor(360 / w);
    svg.setAttribute("width", w * scale + 20);
    svg.setAttribute("height", h * scale + 20);
    const g = el("g", { transform: "translate(10, 10)" }, svg);
    img.pixels.forEach((row, y) => row.forEach((p, x) => {
      const rgb = Array.isArray(p) ? p : [p, p, p];
      const css = "rgb(" + rgb.map((c) => Math.round(255 * c)).join(",") + ")";
      el("rect", { x: x * scale, y: y * scale, width: scale, height: scale, fill: css }, g);
    }));
    const [gh, gw] = img.grid, ph = (h / gh) * scale, pw = (w / gw) * scale;
    const source = state.hover && state.hover.side === "q" ? state.hover.index : 0;
    const row = matrices().map((m) => m.matrix[source]);
    const offset = img.cls ? 1 : 0;
    for (let i = 0; i < gh * gw; i++) {
      const k = i + offset;
      const wsum = row.reduce((s, r) => s + r[k], 0) / row.length;
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
    if (state.display === "image") return;
    const v = view(), hv = state.hover, selfAttn = v.kind !== "cross";
    const outs = [], ins = [];
    document.querySelectorAll(".edge").forEach((e) => {
      e.classList.remove("dim", "out", "in");
      if (!hv) return;
      const q = Number(e.dataset.q), k = Number(e.dataset.k);
      const isOut = q === hv.index && (selfAttn || hv.side === "q");
      const isIn = k === hv.index && (selfAttn || hv.side === "k");
      if (isOut) { e.classList.add("out"); outs.push([k, Number(e.dataset.weight)]); }
      else if (isIn) { e.classList.add("in"); ins.push([q, Number(e.dataset.weight)]); }
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
    const name = (list, i) => JSON.stringify(visible(list[i]));
    const fmt = (pairs, list) => pairs.sort((a, b) => b[1] - a[1]).slice(0, 8)
      .map(([i, w]) => name(list, i) + " " + w.toFixed(3)).join(", ");
    const tokens = hv && (hv.side === "q" ? v.query_tokens : v.key_tokens);
    document.getElementById("info").textContent = hv
      ? name(tokens, hv.index) + " attends to: " + (fmt(outs, v.key_tokens) || "-") +
        "\n" + name(tokens, hv.index) + " is attended by: " + (fmt(ins, v.query_tokens) || "-")
      : "hover a token";
  }

  function legend() {
    const box = document.getElementById("legend");
    box.innerHTML = "";
    const note = document.createElement("span");
    note.textContent = state.display === "image"
      ? "patch tint: attention the patch receives (mean over the heads shown). "
      : (state.display === "graph" ? "arrows: query -> the key it attends to; " : "") +
        "edges below weight " + DATA.threshold + " are not drawn. ";
    box.appendChild(note);
    for (const item of matrices()) {
      const s = document.createElement("span");
      s.className = "swatch";
      s.style.color = item.color;
      s.textContent = "\u25A0 head " + item.head + " ";
      box.appendChild(s);
    }
  }

  function draw() {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    if (state.display === "graph") drawGraph();
    else if (state.display === "image" && DATA.image) drawImage();
    else drawLines();
    legend();
    applyHover();
    document.body.dataset.layer = String(state.layer);
    document.body.dataset.head = String(state.head);
  }

  pick.view.addEventListener("change", () => {
    state.view = Number(pick.view.value); state.hover = null; fillLayerHead(); draw();
  });
  pick.layer.addEventListener("change", () => {
    state.layer = pick.layer.value === "rollout" ? "rollout" : Number(pick.layer.value); draw();
  });
  pick.head.addEventListener("change", () => { state.head = pick.head.value; draw(); });
  pick.display.addEventListener("change", () => {
    state.display = pick.display.value; state.hover = null; draw();
  });
  fillControls();
  if (DATA.image) { state.display = "image"; pick.display.value = "image"; }
  draw();
  document.body.dataset.ready = "1";
})();
"""
