"""qkv.cache.publish_folder: a cache folder appears whole or not at all, and leaves nothing
behind whatever its filling raises."""

import zipfile

import pytest

from qkv.cache import publish_folder
from qkv.models.pretrained import files


def test_the_folder_appears_only_once_filled(tmp_path):
    target = tmp_path / "cache" / "folder"

    def fill(staging):
        assert not target.exists()  # nothing is visible while it is written
        (staging / "a.txt").write_text("a")
        (staging / "sub").mkdir()
        (staging / "sub" / "b.txt").write_text("b")

    assert publish_folder(target, fill) == target
    assert (target / "a.txt").read_text() == "a" and (target / "sub" / "b.txt").read_text() == "b"
    assert sorted(p.name for p in target.parent.iterdir()) == ["folder"]


def test_a_failing_fill_leaves_nothing(tmp_path):
    target = tmp_path / "folder"

    def fill(staging):
        (staging / "half.txt").write_text("half")
        raise ValueError("the source is damaged")

    with pytest.raises(ValueError, match="damaged"):
        publish_folder(target, fill)
    assert list(tmp_path.iterdir()) == []


def test_another_process_s_copy_that_came_first_is_kept(tmp_path):
    target = tmp_path / "folder"

    def fill(staging):
        (staging / "mine.txt").write_text("mine")
        target.mkdir()  # the other process's rename lands first
        (target / "theirs.txt").write_text("theirs")

    assert publish_folder(target, fill) == target
    assert [p.name for p in target.iterdir()] == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]


def test_an_os_error_with_no_copy_is_raised(tmp_path):
    def fill(staging):
        raise PermissionError("no room")

    with pytest.raises(PermissionError):
        publish_folder(tmp_path / "folder", fill)
    assert list(tmp_path.iterdir()) == []


def test_a_broken_checkpoint_archive_leaves_no_partial_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path / "cache"))
    archive = tmp_path / "model.zip"
    archive.write_bytes(b"not a zip file")
    with pytest.raises(zipfile.BadZipFile):
        files._extract_once(archive)
    assert list((tmp_path / "cache" / "checkpoints").iterdir()) == []
