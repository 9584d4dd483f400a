// The served viewer: every row and window comes from the server when it is looked at.
"use strict";
const state = {meta: null, layer: 0, head: 0, query: null, window: null};
const $ = id => document.getElementById(id);

async function get(path, params) {
  const reply = await fetch(path + "?" + new URLSearchParams(params));
  const body = await reply.json();
  if (!reply.ok) throw new Error(body.error);
  return body;
}

function status(text) { $("status").textContent = text; }

function fillSelect(select, count) {
  select.innerHTML = "";
  for (let i = 0; i < count; i++) select.add(new Option(String(i), String(i)));
}

async function showRow(q) {
  state.query = q;
  document.querySelectorAll("#tokens span.query").forEach(s => s.classList.remove("query"));
  const span = $("tokens").children[q];
  span.classList.add("query");
  const t = performance.now();
  const row = await get("/api/row", {layer: state.layer, head: state.head, q});
  const weights = row.weights[0];
  const top = Math.max(...weights);
  Array.from($("tokens").children).forEach((s, k) => {
    const w = k < weights.length ? weights[k] : 0;
    s.style.background = w > 0 ? `rgba(192, 57, 43, ${Math.min(1, w / top)})` : "";
  });
  const order = weights.map((w, k) => [w, k]).sort((a, b) => b[0] - a[0]).slice(0, 12);
  $("row").innerHTML = "<tr><th>key</th><th>token</th><th>weight</th></tr>" + order.map(
    ([w, k]) => `<tr data-key="${k}" data-weight="${w}"><td>${k}</td>` +
      `<td>${escape(state.meta.tokens[k])}</td><td>${w.toFixed(6)}</td></tr>`).join("");
  document.body.dataset.row = `${state.layer},${state.head},${q}`;
  status(`row ${q}: ${(performance.now() - t).toFixed(0)} ms`);
}

function escape(text) {
  return text.replace(/[&<>]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;"})[c]);
}

async function showWindow(q0, q1, k0, k1) {
  const canvas = $("map"), size = canvas.width;
  const t = performance.now();
  const win = await get("/api/window", {layer: state.layer, head: state.head, q0, q1, k0, k1,
                                        size});
  const grid = win.grid, rows = grid.length, cols = grid[0].length;
  const top = Math.max(...grid.map(r => Math.max(...r))) || 1;
  const image = new ImageData(cols, rows);
  grid.forEach((r, i) => r.forEach((v, j) => {
    const p = 4 * (i * cols + j), shade = 255 - Math.round(255 * v / top);
    image.data.set([255, shade, shade, 255], p);
  }));
  const cells = document.createElement("canvas");
  cells.width = cols; cells.height = rows;
  cells.getContext("2d").putImageData(image, 0, 0);
  const context = canvas.getContext("2d");
  context.imageSmoothingEnabled = false;
  context.clearRect(0, 0, size, size);
  context.drawImage(cells, 0, 0, size, size);
  state.window = {q0, q1, k0, k1, fq: win.fq, fk: win.fk, rows, cols, top};
  $("map-info").textContent = `rows ${q0}-${q1 - 1}, keys ${k0}-${k1 - 1}: ` +
    (win.fq === 1 && win.fk === 1 ? "exact" : `each cell the mean of ${win.fq}x${win.fk}`) +
    `, darkest ${top.toFixed(6)}`;
  document.body.dataset.window = `${q0},${q1},${k0},${k1},${win.fq},${win.fk}`;
  status(`window: ${(performance.now() - t).toFixed(0)} ms`);
}

function wholeMap() {
  const layer = state.meta.layers[state.layer];
  return showWindow(0, layer.queries, 0, layer.keys);
}

function zoomAt(event) {
  // Zoom 4x around the clicked point, down to exact weights.
  const w = state.window, rect = $("map").getBoundingClientRect();
  const qc = w.q0 + (event.clientY - rect.top) / rect.height * (w.q1 - w.q0);
  const kc = w.k0 + (event.clientX - rect.left) / rect.width * (w.k1 - w.k0);
  const layer = state.meta.layers[state.layer];
  const span = (lo, hi, c, n) => {
    const half = Math.max(8, Math.floor((hi - lo) / 8));
    const a = Math.max(0, Math.min(n - 2 * half, Math.floor(c) - half));
    return [a, Math.min(n, a + 2 * half)];
  };
  const [q0, q1] = span(w.q0, w.q1, qc, layer.queries);
  const [k0, k1] = span(w.k0, w.k1, kc, layer.keys);
  return showWindow(q0, q1, k0, k1);
}

async function refresh() {
  if (state.query !== null) await showRow(state.query);
  if (state.window) await showWindow(state.window.q0, state.window.q1, state.window.k0,
                                     state.window.k1);
}

async function start() {
  state.meta = await get("/api/meta", {});
  $("title").textContent = state.meta.title;
  state.meta.layers.forEach((l, i) => $("layer").add(new Option(`${l.layer} (${l.name})`,
                                                                  String(i))));
  fillSelect($("head"), state.meta.layers[0].heads);
  const tokens = $("tokens");
  state.meta.tokens.forEach((label, i) => {
    const span = document.createElement("span");
    span.textContent = label;
    span.title = String(i);
    span.dataset.index = String(i);
    tokens.appendChild(span);
  });
  tokens.addEventListener("click", e => {
    if (e.target.dataset.index !== undefined) showRow(Number(e.target.dataset.index));
  });
  $("layer").addEventListener("change", async () => {
    state.layer = Number($("layer").value);
    fillSelect($("head"), state.meta.layers[state.layer].heads);
    state.head = 0;
    await refresh();
  });
  $("head").addEventListener("change", async () => {
    state.head = Number($("head").value);
    await refresh();
  });
  $("whole").addEventListener("click", wholeMap);
  $("map").addEventListener("click", zoomAt);
  await wholeMap();
  document.body.dataset.ready = "1";
}

start().catch(e => status("error: " + e.message));
