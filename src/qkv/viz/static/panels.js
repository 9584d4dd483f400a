
  const TERMS = {  // per kernel: the bar rows' names and the per-dimension term
    dot: { rows: ["q", "k", "q\u00b7k"], term: (a, b) => a * b },
    neg_sqdist: { rows: ["q", "k", "-(q-k)\u00b2"], term: (a, b) => -(a - b) * (a - b) },
    neg_l1: { rows: ["q", "k", "-|q-k|"], term: (a, b) => -Math.abs(a - b) },
  };
  const FEATURES = {  // what the features are, per similarity
    cosine: "q/|q| and k/|k| (unit vectors)", mahalanobis: "qL\u1d40 and kL\u1d40",
  };
  function neuronLayer(v) { return v.neurons.find((n) => n.layer === state.layer); }
  // The last query row with a stored weight, and its strongest key.
  function defaultPair(v, rows) {
    for (let q = v.query_tokens.length - 1; q >= 0; q--) {
      let best = -1, bestW = 0;
      rows.row(q, (k, w) => { if (w > bestW) { best = k; bestW = w; } });
      if (best >= 0) return { q: q, k: best };
    }
    return { q: v.query_tokens.length - 1, k: 0 };
  }

  function drawNeuron() {
    const v = view(), n = neuronLayer(v);
    const text = html("div", { id: "neuron-text" }, stage);
    if (!n) {
      text.textContent = "The neuron view needs a layer whose q and k the page stores: " +
        v.neurons.map((m) => "layer " + v.layers[m.layer]).join(", ") +
        " (qkv viz --neuron-layers picks them). Choose one above.";
      return;
    }
    const h = isFinite(Number(state.head)) ? Number(state.head) : 0;
    const rows = headRows(state.view, state.layer, h);
    const nq = v.query_tokens.length, nk = v.key_tokens.length;
    if (!state.pair) choosePair(...Object.values(defaultPair(v, rows)));
    const { q, k } = state.pair;
    const box = html("div", { id: "neuron-pick" }, stage);
    const input = (id, label, value, max) => {
      html("span", {}, box, " " + label + " ");
      const node = html("input", { id: id, type: "number", min: 0, max: max - 1,
                                   value: value }, box);
      node.addEventListener("change", () => {
        const qq = Number(document.getElementById("neuron-q").value);
        const kk = Number(document.getElementById("neuron-k").value);
        if (qq >= 0 && qq < nq && kk >= 0 && kk < nk) { choosePair(qq, kk); draw(); }
      });
    };
    input("neuron-q", "query", q, nq);
    input("neuron-k", "key", k, nk);
    const d = n.dims, qf = arrayOf(n.q).subarray((h * nq + q) * d, (h * nq + q + 1) * d);
    const kf = arrayOf(n.k).subarray((n.k_of_head[h] * nk + k) * d,
                                     (n.k_of_head[h] * nk + k + 1) * d);
    const kind = TERMS[n.kernel];
    if (!kind) {  // a user-defined term: the page does not know its formula
      text.textContent = "similarity " + n.similarity + " is a user-defined term: its " +
        "per-dimension terms are not drawn here.";
      return;
    }
    const terms = Array.from(qf, (a, i) => kind.term(a, kf[i]));
    const sum = terms.reduce((s, t) => s + t, 0), scale = n.scale[h], total = scale * sum;
    const j = rows.index(q, k);
    const score = j >= 0 ? arrayOf(n.scores[h])[j] : null;
    const simScore = j >= 0 && n.similarity_scores ? arrayOf(n.similarity_scores[h])[j] : null;
    const top = terms.map((t, i) => [i, t]).sort((a, b) => Math.abs(b[1]) - Math.abs(a[1]))
      .slice(0, 5).map(([i, t]) => "d" + i + " " + t.toFixed(4)).join(", ");
    text.textContent = [
      "layer " + v.layers[state.layer] + ", head " + v.heads[h] +
        (isFinite(Number(state.head)) ? "" : " (one head at a time: head " + v.heads[h] + ")") +
        ": query " + q + " " + JSON.stringify(v.query_tokens[q]) + " -> key " + k + " " +
        JSON.stringify(v.key_tokens[k]),
      "similarity " + n.similarity + (FEATURES[n.similarity] ? " on " + FEATURES[n.similarity]
        : "") + ", " + d + " dimensions; largest terms: " + top,
    ].join("\n");
    const numbers = html("div", { id: "neuron-numbers" }, stage);
    html("div", { id: "neuron-total", "data-value": total }, numbers,
         "sum of the terms " + sum.toFixed(5) + " x scale " + scale.toFixed(5) + " = " +
         total.toFixed(5));
    html("div", { id: "neuron-score", "data-value": score === null ? "" : score }, numbers,
         score === null ? "score the layer used: not stored (weight below " + META.threshold + ")"
           : "score the layer used: " + score.toFixed(5) + (simScore === null ? ""
             : " = similarity " + simScore.toFixed(5) + " + score modifier " +
               (score - simScore).toFixed(5)));
    html("div", { id: "neuron-weight" }, numbers, "weight after the softmax: " +
         (j >= 0 ? rows.get(q, k).toFixed(3) : "below " + META.threshold));
    const bw = Math.max(3, Math.min(14, Math.floor(900 / d))), band = 90, left = 80;
    newSvg(left + bw * d + 20, 3 * band + 20);
    [qf, kf, terms].forEach((values, r) => {
      const biggest = Math.max(1e-12, ...Array.from(values, Math.abs));
      const mid = 10 + r * band + band / 2;
      el("text", { x: 4, y: mid + 4, class: "row-name" }, svg).textContent = kind.rows[r];
      el("line", { x1: left, x2: left + bw * d, y1: mid, y2: mid, stroke: "#aaa" }, svg);
      Array.from(values).forEach((value, i) => {
        const height = (Math.abs(value) / biggest) * (band / 2 - 6);
        const rect = el("rect", { class: "bar " + (value >= 0 ? "pos" : "neg"),
          x: left + i * bw, y: value >= 0 ? mid - height : mid, width: Math.max(1, bw - 1),
          height: Math.max(0.5, height), "data-row": ["q", "k", "term"][r], "data-dim": i,
          "data-value": value }, svg);
        el("title", {}, rect).textContent = kind.rows[r] + " d" + i + " = " + value.toFixed(5);
      });
    });
    document.getElementById("info").textContent = "bars: per dimension; pick the pair in " +
      "the matrix view (click a cell) or type it above";
  }

  const sorting = { column: "layer", descending: false };
  function drawSummary() {
    const v = view();
    const names = ["layer", "head", "entropy (bits)", "mean distance", "sink (first token)",
                   "previous token", "left out"];
    const records = [];
    v.layers.forEach((layer, li) => v.heads.forEach((head, hi) => {
      // A head without a map on the page leaves out all of it.
      const mapped = Boolean(v.maps[li][hi]);
      const leftOut = mapped ? v.maps[li][hi].left_out[0] : 1;
      records.push({ li: li, hi: hi, mapped: mapped,
                     values: [layer, head, ...v.summary[li][hi], leftOut] });
    }));
    const column = Math.max(0, names.indexOf(sorting.column));
    records.sort((a, b) => (a.values[column] - b.values[column]) * (sorting.descending ? -1 : 1)
      || a.li - b.li || a.hi - b.hi);
    const table = html("table", { id: "summary" }, stage);
    const head = html("tr", {}, html("thead", {}, table));
    names.forEach((name) => {
      const arrow = name === sorting.column ? (sorting.descending ? " \u25BC" : " \u25B2") : "";
      html("th", { "data-column": name }, head, name + arrow).addEventListener("click", () => {
        sorting.descending = sorting.column === name ? !sorting.descending : true;
        sorting.column = name;
        draw();
      });
    });
    const body = html("tbody", {}, table);
    for (const r of records) {
      const tr = html("tr", { "data-layer": r.li, "data-head": r.hi }, body);
      r.values.forEach((value, i) => {
        const shown = i < 2 ? String(value) : i === 6 && !r.mapped ? "no map"
          : i >= 4 ? (100 * value).toFixed(1) + "%" : value.toFixed(3);
        html("td", { "data-value": value }, tr, shown);
      });
      tr.addEventListener("click", () => {
        select(r.li, r.hi);
        state.display = v.maps[r.li][r.hi] ? "matrix" : "rows";
        pick.display.value = state.display;
        draw();
      });
    }
    document.getElementById("info").textContent = "per head, averaged over query rows: " +
      "entropy of the row, mean |query - key| distance weighted by attention, attention on " +
      "the first token, on the previous token, and the share the page leaves out (all of " +
      "it for a head without a map). Click a " +
      "heading to sort, a row to open the head.";
  }

  DISPLAYS.neuron = { label: "neuron view (one query/key pair)", draw: drawNeuron,
                      available: (v) => v.neurons.length > 0 };
  DISPLAYS.summary = { label: "head summary (table)", draw: drawSummary,
                       available: () => true, withoutMaps: true };
