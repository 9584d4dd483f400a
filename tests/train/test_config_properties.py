"""Property test of the configuration parser: whatever the user types, the answer is a
configuration or one ConfigError line, never a traceback."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv.train.config import ConfigError, RunConfig, flatten, resolve
from qkv.train.tasks import TASKS

SCHEMAS = {name: task.schema for name, task in TASKS.items()}
KEYS = sorted({key for schema in SCHEMAS.values() for key in schema.types})
TRICKY = ["nan", "inf", "-inf", "1e400", "-0", "0", "-1", "true", "[]", "[0]", "[1, 2]",
          "[2, [3]]", '""', "{}", "{a = 1}", "9" * 30, "0.5", "1\nw = 2", "'x'", "cls", "rope"]
texts = st.text(max_size=12)
# Small numbers reach the rules between fields (d_model=32 with n_head=3, patch_size=5 ...).
values = st.one_of(texts, st.sampled_from(TRICKY), st.integers(-3, 40).map(str),
                   st.integers().map(str), st.floats(-3, 3).map(repr),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr))
items = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), values),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), st.integers(0, 40)),
    st.builds(lambda k, v: f"{k}={v}", texts, values), texts,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
trees = st.dictionaries(
    st.one_of(st.sampled_from(["data", "model", "train", "eval", "task"]), texts),
    st.one_of(st.dictionaries(st.one_of(st.sampled_from([k.split(".", 1)[1] for k in KEYS]),
                                        texts), json_values, max_size=4), json_values),
    max_size=4,
)
tasks = st.sampled_from(sorted(TASKS))


def build_or_one_line(task, preset, tree, overrides):
    try:
        cfg = resolve(SCHEMAS[task], task, TASKS[task].presets[preset], tree, overrides)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return
    assert isinstance(cfg, RunConfig)
    # What was accepted is written as config.json and read back for --resume and eval.
    stored = json.loads(json.dumps(cfg.to_dict()))
    assert resolve(SCHEMAS[task], task, flatten(stored, "config.json"), None, []) == cfg


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tasks, st.sampled_from(["default", "tiny"]), st.lists(items, max_size=3))
def test_any_set_items_give_a_config_or_one_line(task, preset, overrides):
    build_or_one_line(task, preset, None, overrides)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tasks, trees)
def test_any_config_file_tree_gives_a_config_or_one_line(task, tree):
    build_or_one_line(task, "tiny", tree, [])
