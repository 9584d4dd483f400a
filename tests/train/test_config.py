import json

import pytest

from qkv.train.config import ConfigError, flatten, parse_value, read_config_file, resolve
from qkv.train.tasks import TASKS


@pytest.fixture
def lm():
    return TASKS["lm"]


def test_defaults_preset_file_and_overrides_in_order(lm, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 7\nlr = 0.01\n[model.positions]\nkind = "rope"\n')
    cfg = resolve(lm.schema, "lm", lm.presets["tiny"], read_config_file(path),
                  ["train.lr=3e-4", "train.compile=true", "data.tokenizer=bpe"])
    assert cfg.train.steps == 7 and cfg.train.lr == 3e-4 and cfg.train.compile is True
    assert cfg.model["positions"]["kind"] == "rope" and cfg.model["block"]["d_model"] == 32
    assert cfg.data.tokenizer == "bpe" and cfg.train.batch_size == 8


def test_the_written_config_round_trips(lm):
    cfg = resolve(lm.schema, "lm", lm.presets["default"], None, ["train.lr=1"])
    stored = json.loads(json.dumps(cfg.to_dict()))
    again = resolve(lm.schema, "lm", flatten(stored, "config.json"), None, [])
    assert again == cfg and isinstance(again.train.lr, float)


def test_unknown_key_lists_close_matches(lm):
    with pytest.raises(ConfigError, match=r"unknown config key 'train.setps'.*train.steps"):
        resolve(lm.schema, "lm", {}, None, ["train.setps=5"])
    with pytest.raises(ConfigError, match="model.block.n_head"):
        resolve(lm.schema, "lm", {}, None, ["model.n_heads=5"])
    with pytest.raises(ConfigError, match="unknown config key 'trian'"):
        resolve(lm.schema, "lm", {}, {"trian": {"steps": 1}}, [])


@pytest.mark.parametrize("item, expected", [
    ("train.steps=abc", "train.steps: expected int, got 'abc'"),
    ("train.steps=1.5", "expected int"),
    ("train.compile=1", "expected bool"),
    ("model.block.n_kv_head=two", "model.block.n_kv_head: expected int | None"),
    ("model.n_head=4", "unknown config key 'model.n_head'; did you mean model.block.n_head"),
    ("model.vocab_size=9", "set from the data"),
    ("trainsteps=1", "section.key=value"),
])
def test_wrong_values_are_one_line_errors(lm, item, expected):
    with pytest.raises(ConfigError, match=expected.replace("|", r"\|")) as info:
        resolve(lm.schema, "lm", {}, None, [item])
    assert "\n" not in str(info.value)


def test_parse_value():
    assert parse_value("3") == 3 and parse_value("1e-3") == 1e-3 and parse_value("true") is True
    assert parse_value("[1, 2]") == [1, 2] and parse_value("rope") == "rope"
    assert parse_value('"007"') == "007"


def test_config_file_for_another_task(lm, tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"task": "vit", "train": {"steps": 1}}')
    with pytest.raises(ConfigError, match="for task 'vit'"):
        resolve(lm.schema, "lm", {}, read_config_file(path), [])
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid"):
        read_config_file(path)


@pytest.mark.parametrize("task, item, expected", [
    ("lm", "train.batch_size=0", "train.batch_size: expected a value in [1, 1e9], got 0"),
    ("lm", "train.accumulate=0", "train.accumulate: expected a value in [1, 1e9]"),
    ("lm", "train.checkpoint_every=0", "train.checkpoint_every: expected a value in [1, 1e9]"),
    ("lm", "train.keep_checkpoints=0", "train.keep_checkpoints: expected a value in [1, 1e9]"),
    ("lm", "model.block_size=0", "model.block_size: expected a value in [1, inf), got 0"),
    ("lm", "train.threads=-3", "train.threads: expected a value in [0, 4096], got -3"),
    ("lm", "train.label_smoothing=2", "train.label_smoothing: expected a value in [0, 1], got 2.0"),
    ("lm", "train.steps=-5", "train.steps: expected a value in [1, 1e9], got -5"),
    ("translate", "eval.beam_size=0", "eval.beam_size: expected a value in [1, inf), got 0"),
    ("lm", "train.schedule=linear", "train.schedule: expected one of cosine, noam, constant"),
    ("lm", "data.test_fraction=1.5", "data.test_fraction: expected a value in (0, 1), got 1.5"),
    ("lm", "train.lr=nan", "train.lr: expected a finite number, got nan"),
    ("lm", "eval.top_p=0", "eval.top_p: expected a value in (0, 1], got 0.0"),
    ("lm", "model.block.norm=batchnorm", "model.block.norm: expected one of layernorm, rmsnorm"),
    ("lm", "model.block.dropout=1", "model.block.dropout: expected a value in [0, 1), got 1.0"),
    ("lm", "model.block.n_head=3", "model: BlockConfig: d_model=32 must be divisible by n_head=3"),
    ("vit", "model.patch_size=[2, 0]", "model.patch_size: expected a value in [1, inf), got 0"),
    ("vit", "model.pooling=max", "model.pooling: expected one of cls, mean, got 'max'"),
    ("translate", "data.tokenizer=word", "data.tokenizer: expected one of bpe, char"),
])
def test_out_of_range_values_name_the_key(task, item, expected):
    schema = TASKS[task].schema
    with pytest.raises(ConfigError) as info:
        resolve(schema, task, TASKS[task].presets["tiny"], None, [item])
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_a_missing_required_model_field_is_named(lm):
    preset = {k: v for k, v in lm.presets["tiny"].items() if k != "model.block_size"}
    with pytest.raises(ConfigError, match=r"^model.block_size is required"):
        resolve(lm.schema, "lm", preset, None, [])


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_field_has_a_range_or_choices(task):
    """Only booleans and file paths go unchecked."""
    schema = TASKS[task].schema
    free = {key for key, hint in schema.types.items()
            if hint in (bool, bool | None) or key in ("data.path", "train.init")}
    assert set(schema.types) - free == set(schema.limits)
