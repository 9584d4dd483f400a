import pickle

import numpy as np
import pytest

from qkv.data import DataError, digits, load_images, read_pairs_tsv, read_text_file
from qkv.data.images import split
from qkv.data.text import split_pairs, split_text


def test_tsv_pairs(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("eins\tone\n\nzwei\ttwo\twith a tab\n", encoding="utf-8")
    assert read_pairs_tsv(path) == [("eins", "one"), ("zwei", "two\twith a tab")]


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), ("", "is empty"), (" \n\n", "is empty"),
     ("eins\tone\nzwei two\n", "line 2 has no tab"), ("\tone\n", "empty side")],
)
def test_bad_tsv_files_are_named(tmp_path, content, message):
    path = tmp_path / "pairs.tsv"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=message):
        read_pairs_tsv(path)


def test_text_file_must_be_utf8_and_nonempty(tmp_path):
    good, bad = tmp_path / "a.txt", tmp_path / "b.txt"
    good.write_text("héllo", encoding="utf-8")
    bad.write_bytes(b"\xff\xfe\xfa")
    assert read_text_file(good) == "héllo"
    with pytest.raises(DataError, match="not UTF-8"):
        read_text_file(bad)
    with pytest.raises(DataError, match="does not exist"):
        read_text_file(tmp_path / "missing.txt")


def test_fixed_splits():
    pairs = [(str(i), str(i)) for i in range(20)]
    train, test = split_pairs(pairs, 0.25, seed=0)
    assert (train, test) == split_pairs(pairs, 0.25, seed=0)
    assert len(test) == 5 and sorted(train + test) == sorted(pairs)
    assert split_text("abcdefghij", 0.2) == ("abcdefgh", "ij")
    with pytest.raises(DataError):
        split_pairs(pairs[:1], 0.5, 0)


def test_digits_split_is_fixed_and_stratified():
    data = digits()
    assert data.images.shape == (1797, 1, 8, 8) and data.images.max() <= 1.0
    train, test = split(data, 0.2, seed=0)
    again, _ = split(data, 0.2, seed=0)
    assert np.array_equal(train.labels, again.labels)
    assert len(train.labels) + len(test.labels) == 1797
    assert set(np.unique(test.labels)) == set(range(10))


def write_png(path, value):
    from matplotlib import image

    image.imsave(path, np.full((6, 6), value, dtype=np.float32), cmap="gray", vmin=0, vmax=1)


def test_image_folder_per_class(tmp_path):
    for name, value in (("cat", 0.1), ("dog", 0.9)):
        (tmp_path / name).mkdir()
        for i in range(2):
            write_png(tmp_path / name / f"{i}.png", value)
    data = load_images(tmp_path, image_size=4)
    assert data.classes == ["cat", "dog"] and list(data.labels) == [0, 0, 1, 1]
    assert data.images.shape[0] == 4 and data.images.shape[2:] == (4, 4)


def test_one_class_is_refused(tmp_path):
    (tmp_path / "only").mkdir()
    write_png(tmp_path / "only" / "a.png", 0.5)
    with pytest.raises(DataError, match="1 class"):
        load_images(tmp_path)
    npz = tmp_path / "one.npz"
    np.savez(npz, images=np.zeros((3, 4, 4)), labels=np.zeros(3, dtype=int))
    with pytest.raises(DataError, match="1 class"):
        load_images(npz)


def test_npz_images(tmp_path):
    npz = tmp_path / "d.npz"
    np.savez(npz, images=np.arange(4 * 16).reshape(4, 4, 4) * 3, labels=np.array([7, 3, 7, 3]))
    data = load_images(npz)
    assert data.images.shape == (4, 1, 4, 4) and data.images.max() <= 1.0
    assert data.classes == ["3", "7"] and list(data.labels) == [1, 0, 1, 0]
    np.savez(npz, pictures=np.zeros(3))
    with pytest.raises(DataError, match="has no 'images' or 'labels' array \\(it holds 'pictures'"):
        load_images(npz)
    np.savez(npz, images=np.zeros((2, 4, 4)), labels_=np.zeros(2))
    with pytest.raises(DataError, match="has no 'labels' array"):
        load_images(npz)


def save_bare_npy(path):
    """A single array saved with np.save, named .npz."""
    with path.open("wb") as f:
        np.save(f, np.zeros(3))


@pytest.mark.parametrize("write", [
    lambda path: path.write_text("not an archive"),
    save_bare_npy,
    lambda path: np.savez(path, images=np.array([{"a": 1}] * 2), labels=np.zeros(2)),
    lambda path: np.savez(path, images=np.array(["x", "y"]), labels=np.zeros(2)),
    lambda path: path.write_bytes(pickle.dumps({"images": [1]})),
])
def test_an_npz_that_is_not_an_image_set_says_so(tmp_path, write):
    npz = tmp_path / "x.npz"
    write(npz)
    with pytest.raises(DataError) as info:
        load_images(npz)
    message = str(info.value)
    assert message.startswith(f"{str(npz)!r} is not an image set")
    assert "pickle" not in message
