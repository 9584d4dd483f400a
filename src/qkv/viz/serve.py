"""``qkv viz --serve``: a local server that computes what the viewer looks at, when it looks.

The forward pass runs once and keeps each layer's q and k on disk (``QKStore``); the page
then asks for a query's row (one head, or all heads of a layer) or a window of a head's map
(exact at full zoom, pooled when zoomed out), and the server computes it from q and k with
the layer's own variant. Nothing of size N x N is ever held, so the first view of 8k tokens
costs one forward pass. It binds 127.0.0.1 only, on a free port. A bad request (a layer,
head or position out of range) gets a 400 with a one-line message.
"""

from __future__ import annotations

import html
import json
import shutil
import tempfile
import threading
import webbrowser
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import torch

from .. import models
from ..allocations import map_large_allocations
from ..train.rundir import load_run
from .labels import token_labels
from .pretrained import greedy_with_rows, load_with_tokenizer
from .qk_store import QKStore
from .scene import encode_text, without_head

# The largest pooled grid a window request may ask for (cells per side).
MAX_WINDOW = 1024


class BadRequest(ValueError):
    """A request the server refuses with 400 and this message."""


class Viewer:
    """What the server answers: the page, the text's tokens and layers, rows and windows."""

    def __init__(self, store: QKStore, labels: list[str], title: str):
        self.store, self.labels, self.title = store, labels, title

    def meta(self) -> dict:
        return {"title": self.title, "tokens": self.labels, "layers": [
            {"name": s.site.name, "layer": s.site.layer, "heads": s.shape[0],
             "queries": s.shape[1], "keys": s.shape[2]} for s in self.store.layers]}

    def _layer(self, query: dict) -> int:
        return _int(query, "layer", 0, len(self.store.layers) - 1)

    def row(self, query: dict) -> dict:
        layer = self._layer(query)
        heads_count, nq, _ = self.store.layers[layer].shape
        head = _one(query, "head")
        heads = list(range(heads_count)) if head == "all" else [
            _int(query, "head", 0, heads_count - 1)]
        q = _int(query, "q", 0, nq - 1)
        weights = self.store.rows(layer, heads, q, q + 1)[:, 0]
        return {"layer": layer, "heads": heads, "q": q, "weights": weights.tolist()}

    def window(self, query: dict) -> dict:
        layer = self._layer(query)
        heads_count, nq, nk = self.store.layers[layer].shape
        head = _int(query, "head", 0, heads_count - 1)
        q0, q1 = _int(query, "q0", 0, nq - 1), _int(query, "q1", 1, nq)
        k0, k1 = _int(query, "k0", 0, nk - 1), _int(query, "k1", 1, nk)
        if q1 <= q0 or k1 <= k0:
            raise BadRequest(f"empty window: q0={q0} q1={q1} k0={k0} k1={k1} (need q0 < q1 "
                             "and k0 < k1)")
        size = _int(query, "size", 1, MAX_WINDOW)
        grid, (fq, fk) = self.store.window(layer, head, (q0, q1), (k0, k1), size)
        return {"layer": layer, "head": head, "q0": q0, "k0": k0, "fq": fq, "fk": fk,
                "grid": grid.tolist()}


def _one(query: dict, name: str) -> str:
    values = query.get(name)
    if not values:
        raise BadRequest(f"missing parameter {name!r}")
    return values[0]


def _int(query: dict, name: str, low: int, high: int) -> int:
    text = _one(query, name)
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(f"{name} must be an integer; got {text!r}") from None
    if not low <= value <= high:
        raise BadRequest(f"{name}={value} is out of range: expected {low}..{high}")
    return value


def _handler(viewer: Viewer, page: bytes):
    routes = {"/api/meta": lambda q: viewer.meta(), "/api/row": viewer.row,
              "/api/window": viewer.window}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            if url.path in ("/", "/index.html"):
                return self._send(HTTPStatus.OK, page, "text/html; charset=utf-8")
            route = routes.get(url.path)
            if route is None:
                return self._json(HTTPStatus.NOT_FOUND, {"error": f"no such path {url.path}"})
            try:
                body = route(parse_qs(url.query))
            except BadRequest as e:
                return self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
            return self._json(HTTPStatus.OK, body)

        def _json(self, status, body):
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status, data: bytes, kind: str):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # requests are not news on the terminal
            pass

    return Handler


def page_html(title: str) -> bytes:
    static = resources.files("qkv.viz") / "static"
    script = (static / "serve.js").read_text(encoding="utf-8")
    style = (static / "serve.css").read_text(encoding="utf-8")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head><body>
<h3 id="title"></h3>
<div id="controls">
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<button id="whole">whole map</button>
<span id="status"></span>
</div>
<div id="tokens"></div>
<div id="panels"><div><canvas id="map" width="512" height="512"></canvas>
<div id="map-info"></div></div>
<div><table id="row"></table></div></div>
<script>{script}</script>
</body></html>""".encode()


class Server:
    """The running server: ``url``, ``stop()``; ``serve_forever`` blocks until stopped."""

    def __init__(self, viewer: Viewer, port: int = 0):
        page = page_html(html.escape(viewer.title))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(viewer, page))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _source(args):
    """(model, tokenizer, title) of ``args``: a pretrained checkpoint or an lm run."""
    if args.model is not None:
        model, tokenizer = load_with_tokenizer(args)
        return model, tokenizer, f"qkv attention: {args.model}"
    if args.run_dir is None:
        raise ValueError("give a run directory (from `qkv train lm`) or --model NAME_OR_PATH")
    run = load_run(args.run_dir)
    if run.task != "lm":
        raise ValueError(f"--serve shows lm runs and pretrained models; {args.run_dir} is a "
                         f"{run.task} run (write its page with -o instead)")
    return run.model, run.tokenizers["tokenizer"], f"qkv attention: {run.path.name}"


def serve_command(args) -> int:
    """``qkv viz --serve``: one forward pass, then the server until Ctrl-C; q and k live in a
    temporary folder that is removed on the way out, however the server stops."""
    for flag, given in (("--png", args.png), ("--chat", args.chat)):
        if given:
            raise ValueError(f"{flag} does not apply to --serve")
    model, tokenizer, title = _source(args)
    model.eval()
    map_large_allocations()  # every window is computed a block of rows at a time
    is_gpt = isinstance(model, models.GPT)
    if args.generate and not is_gpt:
        raise ValueError("--generate needs a decoder (GPT) model")
    limit = model.config.block_size if is_gpt else model.config.max_len
    ids = encode_text(tokenizer, args.text, limit, "--serve", args.generate)
    everything = list(ids)

    def forward():
        if args.generate:  # the prompt once, then one row per token through the cache
            everything[:] = greedy_with_rows(model, ids, args.generate,
                                             getattr(tokenizer, "eos_id", None))
        else:
            with without_head(model):
                model(torch.tensor([ids]))

    folder = Path(tempfile.mkdtemp(prefix="qkv-serve-"))
    store = None
    try:
        store = QKStore.record(model, forward, folder / "qk")
        if args.generate:
            print("generated: " + tokenizer.decode(everything[len(ids):]), flush=True)
        server = Server(Viewer(store, token_labels(tokenizer, everything), title), args.port)
        print(f"serving {len(everything)} tokens, {len(store.layers)} layers at {server.url} "
              "(Ctrl-C stops)", flush=True)
        if args.open:
            webbrowser.open(server.url)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("stopped", flush=True)
        finally:
            server.stop()
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(folder, ignore_errors=True)
    return 0
