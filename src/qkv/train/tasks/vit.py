"""vit: the Vision Transformer on images.

Embedded default: scikit-learn's digits (1,797 real 8x8 images) with a fixed, stratified
split. User data: ``data.path`` names a folder of class folders or an .npz file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ...data import images
from ...models import ViT, ViTConfig
from ..config import SEEDS, Schema, limited
from .common import build


@dataclass
class VitData:
    path: str = ""  # a folder of class folders, or an .npz; empty: scikit-learn's digits
    test_fraction: float = limited(0.2, "(0, 1)")
    split_seed: int = limited(0, SEEDS)
    # User folders: resize to this square size; 0: the first image's size.
    image_size: int = limited(0, "[0, inf)")
    # Augmentation: random translation by up to this many pixels. Off by default: on 8x8
    # digits with 2x2 patches a 1-pixel shift re-bins every patch and costs accuracy.
    shift: int = limited(0, "[0, inf)")


@dataclass
class VitEval:
    batch_size: int = limited(512, "[1, inf)")


PRESETS = {
    "default": {
        "model.patch_size": 2, "model.n_layer": 4, "model.block.d_model": 64,
        "model.block.n_head": 4,
        "model.pooling": "mean", "model.block.dropout": 0.0,
        "train.steps": 1000, "train.batch_size": 128, "train.lr": 3e-3, "train.warmup": 100,
        "train.weight_decay": 0.05, "train.label_smoothing": 0.1, "train.eval_every": 400,
        "train.checkpoint_every": 400, "train.threads": 1,
    },
    "tiny": {
        "model.patch_size": 4, "model.n_layer": 1, "model.block.d_model": 16,
        "model.block.n_head": 2,
        "train.steps": 6, "train.batch_size": 16, "train.warmup": 2,
        "train.checkpoint_every": 3, "train.log_every": 2,
    },
}


def shift_images(x: torch.Tensor, max_shift: int) -> torch.Tensor:
    """Translate each image (B, C, H, W) by a random whole number of pixels in [-s, s] per axis,
    filling with zeros (drawn from torch's global RNG, so checkpoints restore it)."""
    b, _, h, w = x.shape
    padded = F.pad(x, (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, b)).tolist()
    return torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(b)])


class ImageData:
    unit = "img"

    def __init__(self, train: images.ImageSet, test: images.ImageSet, shift: int):
        self.train_images = torch.from_numpy(train.images)
        self.train_labels = torch.from_numpy(train.labels)
        self.test_images = torch.from_numpy(test.images)
        self.test_labels = torch.from_numpy(test.labels)
        self.classes, self.shift = test.classes, shift
        self.train_size = len(self.train_labels)
        self.new_files: dict[str, dict] = {}  # no tokenizers

    def weight(self, index: torch.Tensor) -> int:
        return len(index)

    def batch(self, index: torch.Tensor, device) -> dict:
        x = self.train_images[index]
        if self.shift:
            x = shift_images(x, self.shift)
        return {"x": x.to(device), "y": self.train_labels[index].to(device)}

    def units(self, batch: dict) -> int:
        return len(batch["y"])


def load(data: VitData) -> tuple[images.ImageSet, images.ImageSet]:
    if data.path:
        full = images.load_images(data.path, data.image_size or None)
    else:
        full = images.digits()
    return images.split(full, data.test_fraction, data.split_seed)


class VitTask:
    name = "vit"
    presets = PRESETS

    @property
    def schema(self) -> Schema:
        # The stand-in image is one patch, so the divisibility check passes until the data
        # gives the real size.
        derived = {"image_size": lambda model: model["patch_size"], "in_channels": 1,
                   "num_classes": 2}
        return Schema(VitData, VitEval, ViTConfig, derived)

    def prepare(self, cfg, run_dir: Path | None, env, train: bool = True) -> ImageData:
        train_set, test_set = load(cfg.data)
        return ImageData(train_set, test_set, cfg.data.shift)

    def build_model(self, cfg, data: ImageData):
        _, c, h, _ = data.test_images.shape
        derived = {"image_size": h, "in_channels": c, "num_classes": len(data.classes)}
        return build(ViT, ViTConfig, derived, cfg.model)

    def loss_sum(self, model, batch: dict, train_cfg) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]).float(), batch["y"],
                               label_smoothing=train_cfg.label_smoothing, reduction="sum")

    def evaluate(self, model, data: ImageData, cfg, final: bool) -> dict:
        """Held-out accuracy (%) and the confusion matrix (rows: true class, columns: predicted)."""
        device = next(model.parameters()).device
        predictions = []
        for i in range(0, len(data.test_labels), cfg.eval.batch_size):
            x = data.test_images[i : i + cfg.eval.batch_size].to(device)
            predictions.append(model(x).argmax(-1).cpu())
        predicted = torch.cat(predictions).numpy()
        truth = data.test_labels.numpy()
        k = len(data.classes)
        confusion = np.zeros((k, k), dtype=np.int64)
        np.add.at(confusion, (truth, predicted), 1)
        return {
            "accuracy": 100.0 * float((predicted == truth).mean()),
            "confusion": confusion.tolist(), "classes": data.classes, "images": len(truth),
        }

    def summary(self, result: dict) -> str:
        return f"held-out accuracy {result['accuracy']:.2f}% ({result['images']} images)"

    def report(self, model, data: ImageData, cfg, run_dir: Path, out, heatmap=None) -> None:
        result = self.evaluate(model, data, cfg, final=True)
        width = max(len(c) for c in result["classes"]) + 1
        print("confusion matrix (rows: true class, columns: predicted):", file=out)
        print(" " * width + "".join(c.rjust(5) for c in result["classes"]), file=out)
        for name, row in zip(result["classes"], result["confusion"], strict=True):
            print(name.rjust(width) + "".join(str(v).rjust(5) for v in row), file=out)
