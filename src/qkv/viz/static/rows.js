
  // Per-row summaries of every head (the page of a long input, qkv.viz.page_rows): along the
  // queries the entropy of each row, its mean distance, its first- and previous-token mass;
  // along the keys the mass each receives. One byte a value, decoded here.
  // "mass" (each row's sum of weights) only where the model's rows do not sum to 1.
  const ALL_SERIES = [["entropy", "entropy (bits)"], ["distance", "mean distance (tokens)"],
                      ["sink", "first-token mass"], ["previous", "previous-token mass"],
                      ["received", "mass each key receives"],
                      ["mass", "row mass (sum of weights)"]];
  const seriesOf = (vi) => ALL_SERIES.filter(([name]) => name in META.views[vi].row_stats.scales);
  function decode(ref, scale) {
    const codes = arrayOf(ref), out = new Float32Array(codes.length);
    const kind = scale[0], top = scale[1], span = Math.log2(1 + top);
    for (let i = 0; i < codes.length; i++) {
      const unit = codes[i] / META.levels;
      out[i] = kind === "linear" ? unit * top : Math.pow(2, unit * span) - 1;
    }
    return out;
  }
  function headSeries(vi, li, hi) {
    const stats = META.views[vi].row_stats;
    return cached(vi + "/" + li + "/" + hi + "/rows", () => {
      const out = {};
      for (const [name] of seriesOf(vi)) out[name] = decode(stats.layers[li][hi][name],
                                                            stats.scales[name]);
      return out;
    });
  }
  // One head's series, or their mean over the layer's heads ("mean", "all").
  function shownSeries() {
    const v = view();
    if (isFinite(Number(state.head))) return headSeries(state.view, state.layer,
                                                        Number(state.head));
    return cached(state.view + "/" + state.layer + "/rows-mean", () => {
      const heads = v.heads.map((_, h) => headSeries(state.view, state.layer, h)), out = {};
      for (const [name] of seriesOf(state.view)) {
        out[name] = new Float32Array(heads[0][name].length);
        for (const s of heads) s[name].forEach((x, i) => { out[name][i] += x / heads.length; });
      }
      return out;
    });
  }

  // Each pixel column spans several rows: their range as a light bar, their mean as a line.
  // The y axis is linear, or logarithmic (log2(1 + x)) for distance and received mass.
  function plotSeries(canvas, values, log) {
    const ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height, n = values.length;
    const f = log ? (x) => Math.log2(1 + x) : (x) => x;
    const top = Math.max(1e-9, ...Array.from(values, f));
    const y = (x) => h - 2 - (f(x) / top) * (h - 4);
    ctx.fillStyle = "#fcfcfc"; ctx.fillRect(0, 0, w, h);
    ctx.strokeStyle = "#b8cde0";
    ctx.beginPath();
    const means = [];
    for (let px = 0; px < w; px++) {
      const a = Math.floor((px * n) / w), b = Math.max(a + 1, Math.floor(((px + 1) * n) / w));
      let low = Infinity, high = -Infinity, sum = 0;
      for (let i = a; i < Math.min(b, n); i++) {
        low = Math.min(low, values[i]); high = Math.max(high, values[i]); sum += values[i];
      }
      if (a >= n) break;
      ctx.moveTo(px + 0.5, y(low)); ctx.lineTo(px + 0.5, y(high) - 0.5);
      means.push(sum / (Math.min(b, n) - a));
    }
    ctx.stroke();
    ctx.strokeStyle = "#1f4e79";
    ctx.beginPath();
    means.forEach((m, px) => { if (px) ctx.lineTo(px + 0.5, y(m)); else ctx.moveTo(0.5, y(m)); });
    ctx.stroke();
    const largest = Math.max(...values);  // the top of the axis, its bottom is 0
    ctx.fillStyle = "#666"; ctx.font = "10px sans-serif"; ctx.textBaseline = "top";
    ctx.fillText("max " + (largest >= 10 ? largest.toFixed(0) : largest.toPrecision(3)) +
                 (log ? " (log scale)" : ""), 4, 2);
  }

  function drawRowStats() {
    const v = view(), series = shownSeries(), nq = v.query_tokens.length;
    const width = Math.max(300, Math.min(1100, window.innerWidth - 220));
    const box = html("div", { id: "row-stats" }, stage);
    const readout = html("div", { id: "row-readout" }, box, "");
    for (const [name, label] of seriesOf(state.view)) {
      const values = series[name], keys = name === "received";
      const line = html("div", { class: "row-series" }, box);
      html("span", { class: "row-label" }, line, label + (keys ? " (keys)" : " (queries)"));
      const mean = values.reduce((s, x) => s + x, 0) / values.length;
      const canvas = html("canvas", { class: "series", width: width, height: 64,
        "data-series": name, "data-count": values.length, "data-mean": mean }, line);
      plotSeries(canvas, values, name === "distance" || name === "mass" || keys);
      canvas.addEventListener("mousemove", (event) => {
        const r = canvas.getBoundingClientRect();
        const i = Math.min(values.length - 1, Math.max(0, Math.floor(
          ((event.clientX - r.left) * values.length) / r.width)));
        readout.dataset.series = name;
        readout.dataset.index = i;
        readout.textContent = describeRow(v, series, keys, i);
      });
      canvas.addEventListener("click", (event) => {
        if (keys || !v.maps[state.layer][Number(state.head)]) return;
        const i = Number(readout.dataset.index);  // open the row in the matrix view
        choosePair(i, defaultKey(headRows(state.view, state.layer, Number(state.head)), i));
        state.display = "matrix"; pick.display.value = "matrix"; draw();
      });
    }
    document.getElementById("info").textContent = "per-row summaries of layer " +
      v.layers[state.layer] + ", " + (isFinite(Number(state.head)) ? "head " +
      v.heads[Number(state.head)] : "mean over heads") + ", over " + nq + " queries: a " +
      "pixel column spans " + Math.max(1, Math.round(nq / width)) + " rows (light: their " +
      "range, dark: their mean); hover for one row" + (isFinite(Number(state.head)) &&
      v.maps[state.layer][Number(state.head)] ? ", click to open it in the matrix view" : "");
  }
  function describeRow(v, series, keys, i) {
    if (keys) {
      return "key " + i + " " + JSON.stringify(v.key_tokens[i]) + " receives " +
        series.received[i].toFixed(3) + " (summed over the queries)";
    }
    return "query " + i + " " + JSON.stringify(v.query_tokens[i]) + ": entropy " +
      series.entropy[i].toFixed(2) + " bits, mean distance " + series.distance[i].toFixed(1) +
      ", first token " + series.sink[i].toFixed(3) + ", previous token " +
      series.previous[i].toFixed(3) + ("mass" in series ? ", row mass " +
      series.mass[i].toFixed(3) : "");
  }
  function defaultKey(rows, q) {
    let best = 0, bestW = -1;
    rows.row(q, (k, w) => { if (w > bestW) { best = k; bestW = w; } });
    return best;
  }

  DISPLAYS.rows = { label: "per-row summaries (every head)", draw: drawRowStats,
                    available: (v) => Boolean(v.row_stats), withoutMaps: true };
