"""Building the CPU engines' C sources: the target, the flags and the compiler, and one
shared library per source, compiler, flags and CPU in ``$QKV_CACHE`` (docs/portability.md
covers the targets, compilers and machines). ``native`` loads what this builds."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from ...cache import cache_dir
from ..lowering import c_defines

# -fno-math-errno and -fno-trapping-math change no result; without them the compiler must
# keep each libm call, division or select that could set errno or trap under its condition,
# which keeps such loops from vectorizing. The target (-march) comes first, from march().
# The term kinds come by name (-DQKV_TERM_DOT=0, ...): the C branches on the one enum.
FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared",
          *c_defines()]
# The CPU features (as /proc/cpuinfo names them) each x86-64 level adds to the one before.
X86_LEVELS = {
    "x86-64-v2": "cx16 lahf_lm popcnt pni sse4_1 sse4_2 ssse3",
    "x86-64-v3": "avx avx2 bmi1 bmi2 f16c fma abm movbe xsave",
    "x86-64-v4": "avx512f avx512bw avx512cd avx512dq avx512vl",
}

def cpuinfo_line(key: str) -> str:
    """The first line of /proc/cpuinfo that starts with ``key`` ("" without one, or without
    /proc)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(key)), "")
    except OSError:
        return ""


@functools.cache
def amd_cpu() -> bool:
    """Whether this is an AMD processor, on whose AVX-512 torch's MKL runs its AVX2 code."""
    # Without /proc (Windows), platform.processor(): "AMD64 Family 25 ..., AuthenticAMD".
    return "AuthenticAMD" in (cpuinfo_line("vendor_id") or platform.processor())


def forced_choice(variable: str) -> bool | None:
    """A comparison switch from the environment: True for ``variable=1``, False for ``0``,
    None when it is unset; any other value is refused with the variable's name."""
    forced = os.environ.get(variable, "")
    if forced not in ("", "0", "1"):
        raise ValueError(f"{variable} must be 0, 1 or unset; got {forced!r}")
    return None if not forced else forced == "1"


def march() -> str:
    """The target the C sources are built for: ``$QKV_MARCH``, default ``native`` (this CPU's
    own features). An x86-64 level (``x86-64-v3``) builds code that any CPU of that level
    runs, so a cache built on one machine serves the others."""
    return os.environ.get("QKV_MARCH") or "native"


def missing_features(target: str) -> list[str]:
    """The CPU features x86-64 level ``target`` (and those below it) needs that this CPU lacks
    by /proc/cpuinfo; [] for other targets, or without /proc."""
    if target not in X86_LEVELS:
        return []
    have = set(cpuinfo_line("flags").split(":")[-1].split())
    if not have:
        return []
    levels = list(X86_LEVELS)
    needed = " ".join(X86_LEVELS[level] for level in levels[:levels.index(target) + 1])
    return [feature for feature in needed.split() if feature not in have]


def _compile(compiler: list[str], flags: list[str], source: bytes, stem: str) -> Path:
    """The shared library of C ``source`` built with ``flags``, once per source, compiler,
    flags and, for ``-march=native``, CPU (a content hash names it: a changed source never
    loads a stale build)."""
    # -march=native code is only valid on a CPU with the same feature flags; an x86-64
    # level's on any CPU of that level.
    cpu = cpuinfo_line("flags") if "-march=native" in flags else ""
    key = hashlib.sha256(b"\0".join(
        [source, " ".join(compiler).encode(), " ".join(flags).encode(), cpu.encode()]
    )).hexdigest()[:16]
    target = cache_dir() / f"{stem}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: another process never loads a half-written file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, "-x", "c", "-", "-o", partial], input=source,
                       check=True, capture_output=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def build(compiler: list[str], source: bytes, stem: str,
           extra_flags: tuple[str, ...] = ()) -> Path:
    """``_compile`` for ``-march=`` ``march()``. A compiler that does not know
    ``-march=native`` (a cross compiler; clang before 15 on ARM) builds for its own default
    target instead."""
    flags = [f"-march={march()}", *FLAGS, *extra_flags]
    try:
        return _compile(compiler, flags, source, stem)
    except subprocess.CalledProcessError:
        if march() != "native":
            raise
        return _compile(compiler, flags[1:], source, stem)


def compiler() -> list[str] | None:
    """The C compiler's command (``$CC`` may hold arguments: ``ccache gcc``), or None."""
    if os.environ.get("QKV_NATIVE", "1") == "0":
        return None
    command = shlex.split(os.environ.get("CC", ""))
    found = shutil.which("cc") or shutil.which("gcc")
    return command or ([found] if found else None)
