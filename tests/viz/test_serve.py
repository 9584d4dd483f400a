"""``qkv viz --serve``: what the server sends equals ``qkv.attention``'s weights on the same q
and k (rows and windows at full zoom within 1e-6, pooled windows equal to the pooled exact
map); bad requests get a 4xx with one line; the page, driven in Chromium at position 8,000 of
an 8,192-token text, shows those values; Ctrl-C stops the command and leaves no files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

import qkv
from qkv.models import GPT, GPTConfig
from qkv.viz.qk_store import QKStore
from qkv.viz.serve import Server, Viewer

from .runs import make_lm_run

N = 8192


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A random 2-layer GPT with RoPE over 8,192 tokens, its q and k stored, served."""
    torch.manual_seed(0)
    block = {"n_head": 2, "n_kv_head": 1, "d_model": 32, "dropout": 0.0}
    model = GPT(GPTConfig(vocab_size=50, block_size=N, n_layer=2, block=block,
                          positions={"kind": "rope"})).eval()
    ids = torch.randint(0, 50, (1, N), generator=torch.Generator().manual_seed(1))
    store = QKStore.record(model, lambda: model(ids), tmp_path_factory.mktemp("s") / "qk")
    server = Server(Viewer(store, [f"t{i}" for i in range(N)], "test"))
    server.start()
    try:
        yield store, server
    finally:
        server.stop()
        store.close()


def fetch(server, path, **params):
    query = "&".join(f"{k}={v}" for k, v in params.items())
    with urllib.request.urlopen(f"{server.url}{path}?{query}", timeout=60) as reply:
        return json.loads(reply.read())


def exact(store, layer):
    """The layer's whole (H, N, N) weights from qkv.attention on the stored q and k."""
    q = torch.from_numpy(store.layers[layer].q.astype(np.float32))[None]
    k = torch.from_numpy(store.layers[layer].k.astype(np.float32))[None]
    _, weights = qkv.attention(q, k, k, mask=qkv.causal(), return_weights=True)
    return weights[0]


def test_rows_and_windows_equal_qkv_attention(served):
    store, server = served
    weights = exact(store, 1)
    for q in (0, 1, 4097, 8000, N - 1):
        row = fetch(server, "/api/row", layer=1, head="all", q=q)
        assert np.abs(np.array(row["weights"]) - weights[:, q].numpy()).max() <= 1e-6
    win = fetch(server, "/api/window", layer=1, head=1, q0=7990, q1=8010, k0=7980, k1=8005,
                size=64)
    assert (win["fq"], win["fk"]) == (1, 1)
    assert np.abs(np.array(win["grid"]) - weights[1, 7990:8010, 7980:8005].numpy()).max() <= 1e-6
    # The whole map pooled to 256 x 256: each cell the mean of a 32 x 32 block.
    whole = fetch(server, "/api/window", layer=1, head=0, q0=0, q1=N, k0=0, k1=N, size=256)
    pooled = weights[0].reshape(256, 32, 256, 32).mean((1, 3))
    assert (whole["fq"], whole["fk"]) == (32, 32)
    assert np.abs(np.array(whole["grid"]) - pooled.numpy()).max() <= 1e-7
    # A ragged window: the last cells average over the weights they hold.
    ragged = fetch(server, "/api/window", layer=0, head=0, q0=100, q1=203, k0=0, k1=50, size=10)
    w = exact(store, 0)[0, 100:203, :50]
    assert ragged["fq"] == 11 and ragged["fk"] == 5
    assert abs(ragged["grid"][-1][-1] - float(w[99:, 45:].mean())) <= 1e-7


@pytest.mark.parametrize("query,message", [
    ("/api/row?layer=2&head=0&q=0", "layer=2 is out of range: expected 0..1"),
    ("/api/row?layer=0&head=5&q=0", "head=5 is out of range: expected 0..1"),
    ("/api/row?layer=0&head=0&q=8192", "q=8192 is out of range: expected 0..8191"),
    ("/api/row?layer=0&head=0", "missing parameter 'q'"),
    ("/api/row?layer=x&head=0&q=0", "layer must be an integer; got 'x'"),
    ("/api/window?layer=0&head=0&q0=5&q1=5&k0=0&k1=9&size=4", "empty window"),
    ("/api/nothing", "no such path /api/nothing"),
])
def test_bad_requests_get_a_4xx_and_one_line(served, query, message):
    _, server = served
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.url.rstrip("/") + query, timeout=10)
    assert 400 <= info.value.code < 500
    body = json.loads(info.value.read())
    assert message in body["error"] and "\n" not in body["error"]


def test_the_page_at_position_8000(served, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    store, server = served
    browser.get(server.url)
    WebDriverWait(browser, 60).until(
        lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    browser.save_screenshot(str(tmp_path / "1-first-view.png"))

    def shown_row():
        rows = browser.find_elements(By.CSS_SELECTOR, "#row tr[data-key]")
        return {int(r.get_attribute("data-key")): float(r.find_elements(By.TAG_NAME, "td")[2]
                                                        .text) for r in rows}

    def wait_for(key, value):
        WebDriverWait(browser, 30).until(
            lambda d: d.execute_script(f"return document.body.dataset.{key}") == value)

    token = browser.find_element(By.CSS_SELECTOR, '#tokens span[data-index="8000"]')
    browser.execute_script("arguments[0].scrollIntoView()", token)
    token.click()
    wait_for("row", "0,0,8000")
    browser.save_screenshot(str(tmp_path / "2-row-8000.png"))
    weights = exact(store, 0)[0, 8000]
    shown = shown_row()
    assert len(shown) == 12
    for key, value in shown.items():
        assert abs(value - float(weights[key])) <= 5e-7, key
    assert set(shown) == set(weights.topk(12).indices.tolist())

    Select(browser.find_element(By.ID, "layer")).select_by_value("1")
    wait_for("row", "1,0,8000")
    Select(browser.find_element(By.ID, "head")).select_by_value("1")
    wait_for("row", "1,1,8000")
    browser.save_screenshot(str(tmp_path / "3-layer-1-head-1.png"))
    weights = exact(store, 1)[1, 8000]
    assert all(abs(v - float(weights[k])) <= 5e-7 for k, v in shown_row().items())

    browser.find_element(By.ID, "whole").click()
    wait_for("window", f"0,{N},0,{N},16,16")
    browser.save_screenshot(str(tmp_path / "4-whole-map.png"))
    assert "each cell the mean of 16x16" in browser.find_element(By.ID, "map-info").text
    for path in tmp_path.glob("*.png"):
        assert path.stat().st_size > 1000


def test_the_command_serves_and_stops_on_ctrl_c_leaving_no_files(tmp_path):
    run = tmp_path / "run"
    make_lm_run(run, ["model.block_size=128"])
    text = tmp_path / "text.txt"
    text.write_text("the cat sat " * 5, encoding="utf-8")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "qkv.cli", "viz", str(run), "--serve", "--no-open",
         "--text-file", str(text), "--generate", "3"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline().startswith("generated: ")
        line = process.stdout.readline()
        assert line.startswith("serving 63 tokens"), (line, process.stderr.read())
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "api/row?layer=0&head=0&q=62", timeout=30) as reply:
            assert abs(sum(json.loads(reply.read())["weights"][0]) - 1) <= 1e-5
        assert any(scratch.iterdir())  # q and k on disk while serving
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert "stopped" in out and "Traceback" not in err
    assert not any(scratch.iterdir())


def test_generated_rows_follow_the_prompt_without_recomputing_it(tmp_path):
    """A prompt, then tokens through the KV cache: the store keeps the prompt's q and k from
    the one prompt call and each generated row after it, equal to one pass over the whole
    sequence."""
    from qkv.viz.pretrained import greedy_with_rows

    torch.manual_seed(3)
    block = {"n_head": 2, "n_kv_head": 1, "d_model": 32, "dropout": 0.0}
    model = GPT(GPTConfig(vocab_size=50, block_size=64, n_layer=2, block=block,
                          positions={"kind": "rope"})).eval()
    prompt = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    tokens = []
    store = QKStore.record(model, lambda: tokens.extend(greedy_with_rows(model, prompt, 5,
                                                                         None)),
                           tmp_path / "qk")
    try:
        assert store.layers[0].shape == (2, 45, 45)
        whole = QKStore.record(model, lambda: model(torch.tensor([tokens])), tmp_path / "all")
        for layer in range(2):
            got = store.rows(layer, [0, 1], 38, 45)
            want = whole.rows(layer, [0, 1], 38, 45)
            assert (got - want).abs().max() <= 1e-3  # float16 q and k from two computations
        whole.close()
    finally:
        store.close()
    assert not (tmp_path / "qk").exists()


def test_serve_refuses_what_it_cannot_show(tmp_path, capsys):
    from qkv.cli import main

    run = tmp_path / "run"
    make_lm_run(run)
    for extra, message in ((["--png", "pics"], "--png does not apply to --serve"),
                           (["--port", "70000"], "--port must be in 0..65535")):
        start = time.perf_counter()
        assert main(["viz", str(run), "--serve", "--text", "the cat", *extra]) == 2
        assert message in capsys.readouterr().err
        assert time.perf_counter() - start < 30
