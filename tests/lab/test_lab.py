"""``qkv lab``: tiny 2-variant x 2-seed labs trained in the test process (``--jobs 1``), their
results.json and Welch intervals, resuming, a failing variant, bad lab files, the page."""

import json
import shutil
import xml.etree.ElementTree as ET

import pytest
from scipy import stats as scipy_stats

from qkv import cli
from qkv.lab import stats

from .conftest import finished_lab

LAB = """
[lab]
task = "lm"
preset = "tiny"
seeds = [0, 1]
set = ["train.steps=4", "train.checkpoint_every=2"]
[variants.dot]
[variants.l1]
set = ["model.block.similarity=l1"]
"""


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Keep the docstrings cache out of the user's home."""
    monkeypatch.setenv("QKV_CACHE", str(tmp_path_factory.getbasetemp() / "qkv-cache"))


def lab(capsys, path, out, *extra):
    code = cli.main(["lab", str(path), "-o", str(out), "--jobs", "1", "--threads", "1",
                     "--quiet", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A finished 2 x 2 lab: (lab file, output folder)."""
    out = finished_lab(tmp_path_factory, LAB)
    return out.parent / "lab.toml", out


def test_results_hold_every_run_and_the_welch_interval(done):
    _, out = done
    results = json.loads((out / "results.json").read_text())
    assert results["baseline"] == "dot" and results["metric"] == "loss" and results["complete"]
    assert "Welch" in results["interval"]
    for name in ("dot", "l1"):
        v = results["variants"][name]
        assert [r["seed"] for r in v["runs"]] == [0, 1] and v["failed"] == []
        for r in v["runs"]:
            assert r["run_dir"] == f"runs/{name}-s{r['seed']}"
            assert (out / r["run_dir"] / "config.json").is_file()
            assert r["throughput"] > 0 and r["peak_memory_bytes"] > 0 and r["parameters"] > 0
            stored = json.loads((out / r["run_dir"] / "config.json").read_text())
            assert stored["train"]["seed"] == r["seed"] and stored["train"]["threads"] == 1
    assert results["variants"]["dot"]["vs_baseline"] is None
    # By hand: Welch's t interval from the two seeds' losses of each variant.
    a = [r["loss"] for r in results["variants"]["l1"]["runs"]]
    b = [r["loss"] for r in results["variants"]["dot"]["runs"]]
    ma, mb = sum(a) / 2, sum(b) / 2
    va, vb = sum((x - ma) ** 2 for x in a), sum((x - mb) ** 2 for x in b)  # n - 1 = 1
    se2 = va / 2 + vb / 2
    df = se2**2 / ((va / 2) ** 2 + (vb / 2) ** 2)
    half = scipy_stats.t.ppf(0.975, df) * se2**0.5
    vs = results["variants"]["l1"]["vs_baseline"]
    assert vs["difference"] == pytest.approx(ma - mb, abs=1e-12)
    assert vs["df"] == pytest.approx(df, rel=1e-9)
    assert vs["interval"] == pytest.approx([ma - mb - half, ma - mb + half], rel=1e-9)
    assert vs["within_noise"] == (vs["interval"][0] <= 0 <= vs["interval"][1])
    assert results["variants"]["l1"]["std"] == pytest.approx(va**0.5, rel=1e-12)


def test_seed_gives_every_variant_the_same_data_order(done):
    """Same seed, same parameter list: the first step's loss differs only by the variant."""
    _, out = done
    first = {}
    for run in ("dot-s0", "dot-s1"):
        lines = (out / "runs" / run / "metrics.jsonl").read_text().splitlines()
        first[run] = json.loads(lines[0])["loss"]
    assert first["dot-s0"] != first["dot-s1"]


def test_t_quantile_matches_scipy():
    for df in (1.0, 1.7, 3.0, 12.5, 200.0):
        assert stats.t_quantile(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df),
                                                            rel=1e-9)


def test_report_is_offline_and_well_formed(done):
    _, out = done
    text = (out / "report.html").read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text
    assert text.startswith("<!DOCTYPE html>\n")
    root = ET.fromstring(text.split("\n", 1)[1])  # the rest parses as XML: every tag closed
    assert root.tag == "html"
    assert len(root.findall(".//svg/polygon")) == 2  # one band over the seeds per variant
    verdict = root.findall(".//tbody/tr")[1].find("td[@class='verdict']/span")
    results = json.loads((out / "results.json").read_text())
    noise = results["variants"]["l1"]["vs_baseline"]["within_noise"]
    assert verdict.text == ("within noise" if noise else verdict.get("class"))


def test_rerun_trains_only_what_is_missing(done, tmp_path, capsys):
    """An interrupted run (its mark and newest checkpoint gone, as after Ctrl-C at step 2)
    resumes from its checkpoint to the same numbers; the finished runs are not touched."""
    path, first = done
    out = tmp_path / "out"
    shutil.copytree(first, out)
    run = out / "runs" / "l1-s1"
    before = json.loads((run / "lab.json").read_text())
    (run / "lab.json").unlink()
    shutil.rmtree(run / "checkpoints" / "step-000004")
    marks = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/lab.json")}
    code, stdout, _ = lab(capsys, path, out)
    assert code == 0 and stdout.splitlines()[2].startswith("l1 ")
    assert {p: p.stat().st_mtime_ns for p in marks} == marks
    after = json.loads((run / "lab.json").read_text())
    assert after["result"]["loss"] == pytest.approx(before["result"]["loss"], abs=1e-6)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2, 3, 4]
    code, _, _ = lab(capsys, path, out)  # all finished: nothing to train
    assert code == 0


def test_a_failing_variant_is_reported_and_the_others_go_on(tmp_path, capsys):
    path = tmp_path / "lab.toml"
    path.write_text(LAB.replace("seeds = [0, 1]", "seeds = [0]") + (
        '[variants.broken]\nset = ["data.max_chars=50"]\n'))  # too little text: fails at start
    code, stdout, _ = lab(capsys, path, tmp_path / "out")
    assert code == 1
    assert "broken-s0 failed: model.block_size=16 is too long for the text" in stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["variants"]["broken"]["n"] == 0 and not results["complete"]
    assert "too long" in results["variants"]["broken"]["failed"][0]["error"]
    assert results["variants"]["l1"]["n"] == 1 and results["variants"]["dot"]["n"] == 1


@pytest.mark.parametrize("change, named", [
    (("seeds = [0, 1]", "sedes = [0, 1]"), "unknown key lab.sedes"),
    (('task = "lm"', 'task = "lmm"'), "lab.task: unknown task 'lmm'"),
    (("similarity=l1", "simlarity=l1"), "variants.l1.set: unknown config key "
                                         "'model.block.simlarity'"),
    (("similarity=l1", "similarity=nope"), "variants.l1.set: model.block.similarity"),
    (("train.steps=4", "train.steps=four"), "lab.set: train.steps"),
    (("[variants.l1]", "[variants.l1]\nsteps = 3"), "unknown key variants.l1.steps"),
    (("train.steps=4", "train.seed=4"), "lab.set: train.seed is set by lab.seeds"),
])
def test_a_bad_lab_file_is_one_line_naming_the_key(tmp_path, capsys, change, named):
    path = tmp_path / "lab.toml"
    path.write_text(LAB.replace(*change))
    code, stdout, err = lab(capsys, path, tmp_path / "out")
    assert code == 2 and stdout == ""
    assert err.startswith(f"qkv: error: {named}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # refused before any run


def test_a_changed_lab_file_is_refused_over_its_old_runs(done, tmp_path, capsys):
    path, first = done
    shutil.copytree(first, tmp_path / "out")
    changed = tmp_path / "lab.toml"
    changed.write_text(path.read_text().replace("similarity=l1", "similarity=cosine"))
    code, _, err = lab(capsys, changed, tmp_path / "out")
    assert code == 2 and "model.block.similarity='l1'" in err and err.count("\n") == 1


@pytest.mark.slow
def test_parallel_runs_in_processes(tmp_path, capsys):
    """--jobs 2: each run in a process of its own, the same numbers as in this process."""
    path = tmp_path / "lab.toml"
    path.write_text(LAB.replace("seeds = [0, 1]", "seeds = [0]"))
    code = cli.main(["lab", str(path), "-o", str(tmp_path / "out"), "--jobs", "2",
                     "--threads", "1", "--quiet"])
    assert code == 0, capsys.readouterr()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [v["n"] for v in results["variants"].values()] == [1, 1]
    assert (tmp_path / "out" / "logs" / "dot-s0.log").is_file()
