"""Image classification data: scikit-learn's digits, a folder of images per class, or an .npz.

Every loader returns an ``ImageSet``: images (N, C, H, W) float32 scaled to [0, 1], integer
labels (N,) and the class names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass
class ImageSet:
    images: np.ndarray  # (N, C, H, W) float32 in [0, 1]
    labels: np.ndarray  # (N,) int64
    classes: list[str]

    def subset(self, index: np.ndarray) -> ImageSet:
        return ImageSet(self.images[index], self.labels[index], self.classes)


def digits() -> ImageSet:
    """scikit-learn's 1,797 real 8x8 handwritten digits (shipped inside the package)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]
    return ImageSet(images, bunch.target.astype(np.int64), [str(c) for c in bunch.target_names])


def split(data: ImageSet, test_fraction: float, seed: int) -> tuple[ImageSet, ImageSet]:
    """A fixed, seeded, per-class (stratified) split into (train, held-out)."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in range(len(data.classes)):
        members = rng.permutation(np.flatnonzero(data.labels == c))
        n_test = int(round(len(members) * test_fraction))
        test.append(members[:n_test])
        train.append(members[n_test:])
    return data.subset(np.sort(np.concatenate(train))), data.subset(np.sort(np.concatenate(test)))


def check_classes(labels: np.ndarray, classes: list[str], where: str) -> None:
    present = np.unique(labels)
    if len(present) < 2:
        raise DataError(f"{where} holds {len(present)} class; a classifier needs at least 2")


def load_npz(path: str | Path) -> ImageSet:
    """An .npz with ``images`` (N, H, W) or (N, C, H, W) and integer ``labels`` (N,)."""
    path = Path(path)
    where = repr(str(path))
    if not path.is_file():
        raise DataError(f"image file {where} does not exist")
    not_images = (f"{where} is not an image set: expected a NumPy .npz archive of numeric "
                  "arrays 'images' and 'labels'")
    try:
        arrays = np.load(path)  # no pickles: anything but plain arrays fails here or below
    except (OSError, ValueError, EOFError):
        raise DataError(not_images) from None
    if not isinstance(arrays, np.lib.npyio.NpzFile):  # a bare .npy under an .npz name
        raise DataError(not_images)
    with arrays:
        missing = [name for name in ("images", "labels") if name not in arrays.files]
        if missing:
            held = ", ".join(repr(f) for f in arrays.files) or "no arrays"
            raise DataError(f"{where} has no {' or '.join(map(repr, missing))} array (it holds "
                            f"{held})")
        try:
            images, labels = arrays["images"], arrays["labels"]
        except (OSError, ValueError):
            raise DataError(not_images) from None
    if not all(np.issubdtype(a.dtype, np.number) for a in (images, labels)):
        raise DataError(not_images)
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4 or labels.ndim != 1 or len(images) != len(labels) or len(images) == 0:
        raise DataError(
            f"{where}: expected images (N, H, W) or (N, C, H, W) and labels (N,), got "
            f"{images.shape} and {labels.shape}"
        )
    images = images.astype(np.float32)
    if images.max() > 1.0:
        images = images / 255.0
    values, labels = np.unique(labels, return_inverse=True)
    check_classes(labels, [str(v) for v in values], where)
    return ImageSet(images, labels.astype(np.int64), [str(v) for v in values])


def load_folder(path: str | Path, image_size: int | None = None) -> ImageSet:
    """A folder with one subfolder per class, each holding images, resized to ``image_size``
    (default: the first image's size).

    Images are read with matplotlib (PNG natively; other formats through Pillow when
    installed), converted to grayscale when the folder mixes channel counts.
    """
    from matplotlib import image as mpimg

    root = Path(path)
    if not root.is_dir():
        raise DataError(f"image folder {str(root)!r} does not exist")
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir())
    if len(class_dirs) < 2:
        raise DataError(
            f"image folder {str(root)!r} holds {len(class_dirs)} class folder(s); "
            "a classifier needs at least 2"
        )
    images, labels = [], []
    for label, folder in enumerate(class_dirs):
        files = sorted(f for f in folder.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise DataError(f"class folder {str(folder)!r} holds no images")
        for f in files:
            try:
                pixels = np.asarray(mpimg.imread(f), dtype=np.float32)
            except Exception as e:  # any decoder failure names the file
                raise DataError(f"cannot read image {str(f)!r}: {e}") from None
            image_size = image_size or max(pixels.shape[:2])
            images.append(to_chw(pixels, image_size))
            labels.append(label)
    shapes = {im.shape for im in images}
    if len(shapes) > 1:
        images = [im.mean(axis=0, keepdims=True) for im in images]
    return ImageSet(np.stack(images), np.array(labels, np.int64), [d.name for d in class_dirs])


def to_chw(pixels: np.ndarray, image_size: int) -> np.ndarray:
    """(H, W) or (H, W, C) pixels -> (C, H, W) in [0, 1], resized to a square by nearest pixel."""
    if pixels.max() > 1.0:
        pixels = pixels / 255.0
    chw = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)[:3]
    rows = np.arange(image_size) * chw.shape[1] // image_size
    cols = np.arange(image_size) * chw.shape[2] // image_size
    chw = chw[:, rows][:, :, cols]
    return np.ascontiguousarray(chw, dtype=np.float32)


def load_images(path: str | Path, image_size: int | None = None) -> ImageSet:
    """A user's images: an .npz file or a folder of class folders."""
    if str(path).endswith(".npz"):
        return load_npz(path)
    return load_folder(path, image_size)
