"""Run directories written before the model configs had sections (flat ``model.n_head``
keys, ``ffn.linear1`` and ``positions.learned.table`` weights) still load, evaluate and
resume, with the same outputs; a flat key given now is refused with its new place."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qkv.cli import main
from qkv.train import checkpoint, config, run
from qkv.train.config import ConfigError
from qkv.train.rundir import load_run
from qkv.train.tasks import TASKS

from .conftest import tiny_lm

# Parameter names of the layers as the old runs saved them (suffix -> old suffix).
OLD_NAMES = {"ffn.gate_proj.": "ffn.linear1.", "ffn.up_proj.": "ffn.gate.",
             "ffn.down_proj.": "ffn.linear2.", "positions.table.": "positions.learned.table."}


def flat(model: dict) -> dict:
    """A sectioned model config dict in the flat form of the old run directories."""
    out = {k: v for k, v in model.items() if k not in ("block", "positions")}
    out.update(model.get("block", {}))
    positions = model.get("positions", {})
    if "kind" in positions:
        out["positions"] = positions["kind"]
    if "rope_base" in positions:
        out["rope_base"] = positions["rope_base"]
    return out


def make_old(run_dir) -> None:
    """Rewrite a run directory into the old layout, checkpoint manifest included."""
    for name in ("config.json", "model.json"):
        tree = json.loads((run_dir / name).read_text())
        if name == "config.json":
            tree["model"] = flat(tree["model"])
        else:
            tree = flat(tree)
        (run_dir / name).write_text(json.dumps(tree))
    for folder in checkpoint.list_checkpoints(run_dir):
        weights = load_file(folder / "model.safetensors")
        renamed = {}
        for key, value in weights.items():
            for new, old in OLD_NAMES.items():
                key = key.replace(new, old)
            renamed[key] = value
        assert renamed.keys() != weights.keys()
        save_file(renamed, folder / "model.safetensors")
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["sha256"] = {n: checkpoint.sha256(folder / n) for n in manifest["sha256"]}
        (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4-step SwiGLU run twice: as written now, and rewritten into the old form."""
    dirs = []
    for name in ("new", "old"):
        run_dir = tmp_path_factory.mktemp(name) / "run"
        assert main(tiny_lm(run_dir, 4, "--set", "train.checkpoint_every=4",
                            "--set", "model.block.ffn=swiglu")) == 0
        dirs.append(run_dir)
    make_old(dirs[1])
    return dirs


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 2, 3, 4, 5]]))


def test_an_old_run_directory_loads_with_the_same_model(runs):
    new, old = runs
    assert "n_head" in json.loads((old / "model.json").read_text())
    _, cfg, _, model = run.load(old)
    assert cfg.model["block"]["ffn"] == "swiglu" and cfg.model["block"]["n_head"] == 2
    _, _, _, reference = run.load(new)
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=0)
    viewer = load_run(old)  # the viewer reads model.json, not the run config
    assert viewer.model.config == reference.config
    torch.testing.assert_close(logits(viewer.model), logits(reference), rtol=0, atol=0)


def test_an_old_run_resumes(runs):
    _, old = runs
    assert main(tiny_lm(old, 6, "--resume")) == 0
    assert [p.name for p in checkpoint.list_checkpoints(old)][0] == "step-000006"


@pytest.mark.parametrize("key, new_place", [
    ("model.n_head=4", "model.block.n_head"), ("model.positions=rope", "model.positions.kind"),
    ("model.rope_base=500.0", "model.positions.rope_base"),
    ("model.similarity=l1", "model.block.similarity"),
])
def test_a_flat_key_given_now_names_its_new_place(key, new_place, tmp_path, capsys):
    assert main(tiny_lm(tmp_path / "run", 2, "--set", key)) == 2
    err = capsys.readouterr().err
    assert f"set {new_place}" in err and not (tmp_path / "run").exists()


def test_a_config_file_of_the_flat_form_still_loads():
    """An old run's config.json is a --config file: its flat model keys move to their
    sections (the sectioned form wins where a file gives both)."""
    task = TASKS["lm"]
    nested = config.resolve(task.schema, "lm", task.presets["tiny"],
                            {"model": {"block": {"d_model": 64}, "positions": {"kind": "rope"}}},
                            [])
    assert nested.model["block"] == {"n_head": 2, "d_model": 64}
    assert nested.model["positions"] == {"kind": "rope"}
    old = config.resolve(task.schema, "lm", task.presets["tiny"],
                         {"model": {"d_model": 64, "positions": "rope"}}, [])
    assert old.model == nested.model
    both = config.resolve(task.schema, "lm", task.presets["tiny"],
                          {"model": {"d_model": 48, "block": {"d_model": 64}}}, [])
    assert both.model["block"]["d_model"] == 64
    with pytest.raises(ConfigError, match="model.d_model has moved.*set model.block.d_model"):
        config.resolve(task.schema, "lm", task.presets["tiny"], None, ["model.d_model=64"])
