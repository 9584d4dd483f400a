import pytest
import torch

from qkv.train import checkpoint


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.out = torch.nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight


def save_three(run_dir):
    model = Tied()
    for step in (1, 2, 3):
        with torch.no_grad():
            model.emb.weight.fill_(step)
        state = {"step": step, "rng": [torch.get_rng_state()]}
        checkpoint.save(run_dir, step, model, state, keep=2)
    return model


def test_newest_checkpoints_kept_and_weights_restored_tied(tmp_path):
    save_three(tmp_path)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-000003", "step-000002"]
    found = checkpoint.load_latest(tmp_path)
    model = Tied()
    found.load_weights(model)
    assert found.step == 3 and found.trainer_state["step"] == 3
    assert torch.all(model.out.weight == 3) and model.out.weight is model.emb.weight


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_checkpoint_is_named_and_the_previous_used(tmp_path, capsys):
    save_three(tmp_path)
    flip_a_byte(tmp_path / "checkpoints" / "step-000003" / "model.safetensors")
    found = checkpoint.load_latest(tmp_path)
    assert found.step == 2
    err = capsys.readouterr().err
    assert "step-000003 is corrupt (model.safetensors does not match its SHA-256" in err


def test_all_corrupt_stops_cleanly(tmp_path):
    save_three(tmp_path)
    (tmp_path / "checkpoints" / "step-000003" / "manifest.json").unlink()
    flip_a_byte(tmp_path / "checkpoints" / "step-000002" / "trainer.pt")
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint.*manifest.json"):
        checkpoint.load_latest(tmp_path)


def test_an_interrupted_save_is_invisible(tmp_path, monkeypatch):
    save_three(tmp_path)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 4, Tied(), {"step": 4}, keep=2)
    assert checkpoint.load_latest(tmp_path).step == 3
    assert checkpoint.load_latest(tmp_path / "nothing") is None


def test_keeping_no_checkpoint_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="keep must be at least 1"):
        checkpoint.save(tmp_path, 1, Tied(), {"step": 1}, keep=0)
    assert not (tmp_path / "checkpoints").exists()
