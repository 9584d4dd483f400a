import json
import os
import stat

import pytest

from qkv.data.atomic import write_atomic, write_json_atomic


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "state.json"
    write_json_atomic(path, {"step": 1})

    def crash(temp):
        with open(temp, "w") as f:
            f.write('{"step": 2, "tor')
        raise KeyboardInterrupt  # as if killed mid-write

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, crash)
    assert json.loads(path.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_write_creates_folders(tmp_path):
    write_json_atomic(tmp_path / "a" / "b.json", [1])
    assert json.loads((tmp_path / "a" / "b.json").read_text()) == [1]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_files_get_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "config.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "config.json").stat().st_mode) == mode
