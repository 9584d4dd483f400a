
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

  DISPLAYS.lines = { label: "head view: lines between tokens", draw: drawLines,
                     available: () => true };
  DISPLAYS.graph = { label: "graph of the layer", draw: drawGraph, available: () => true };
  if (META.image) {
    DISPLAYS.image = { label: "patches on the image", draw: drawImage, available: () => true };
  }
