"""The C sources on aarch64: cross-compiled with Debian's gcc-aarch64-linux-gnu (warnings are
errors), the tile kernels and the team runner run under qemu-user (native_harness.c), and
their outputs agree with this machine's build and with torch in float64. Without AVX the
kernels take their portable vectors (16 bytes: NEON's), and the AVX-512 flash engine builds
its stub. Skipped only where the cross tools are missing, never in CI (.ci/run installs
them)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from qkv.core.scores import UserScoreMod
from qkv.engines.cpu import build, cpu_flash, native
from qkv.engines.kernelgen import c as c_target
from qkv.engines.kernelgen import c_mod
from qkv.engines.kernelgen.graph import Graph
from qkv.engines.kernelgen.trace import trace_score_mod, trace_term
from qkv.engines.lowering import TermKind

from .test_traced_functions import mod, term

CROSS, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", Path("/usr/aarch64-linux-gnu")
ENGINES = Path(native.__file__).parent
HARNESS = Path(__file__).with_name("native_harness.c")
# What native.py builds with, less -shared (the harness links the kernels in).
FLAGS = [f for f in build.FLAGS if f != "-shared"]
WARNINGS = ["-Wall", "-Wextra", "-Werror"]

if not (shutil.which(CROSS) and shutil.which(QEMU) and (SYSROOT / "lib/libgomp.so.1").exists()):
    if os.environ.get("CI"):
        raise RuntimeError("the aarch64 cross tools are missing; .ci/run installs them")
    pytest.skip("apt-get install gcc-aarch64-linux-gnu libc6-arm64-cross libgomp1-arm64-cross "
                "qemu-user", allow_module_level=True)
if build.compiler() is None:
    pytest.skip("no C compiler for this machine's build", allow_module_level=True)

# native_harness.c's shapes and its generator (next_value).
NB, M, N, D, E, NODES, HEADS = 2, 37, 70, 48, 90, 11, 2


def _build(compiler: list[str], out: Path, *flags: str) -> Path:
    kernels = out.with_suffix(".kernels.c")  # one library's sources, as native builds them
    kernels.write_bytes(b"\n".join(f.read_bytes() for f in native.SOURCES))
    _run([*compiler, *flags, *FLAGS, "-fopenmp", str(kernels),
          str(ENGINES / "workers_team.c"), str(HARNESS), "-o", str(out), "-lm"])
    return out


def _run(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def _outputs(command: list[str]) -> dict[str, torch.Tensor]:
    lines = _run(command).stdout.split("\n")
    found, i = {"vector_bytes": int(lines[0].split()[1])}, 1
    while lines[i]:
        name, count = lines[i].split()
        found[name] = torch.tensor([float.fromhex(x) for x in lines[i + 1:i + 1 + int(count)]],
                                   dtype=torch.float64)
        i += 1 + int(count)
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each build's outputs: aarch64 under qemu, and this machine's."""
    out = tmp_path_factory.mktemp("aarch64")
    arm = _build([CROSS], out / "harness_arm", *WARNINGS)
    # gcc where there is one: $CC may lack -fopenmp (Debian's clang without libomp-dev)
    here = _build([shutil.which("gcc")] if shutil.which("gcc") else build.compiler(),
                  out / "harness_here", f"-march={build.march()}")
    return _outputs(_on_arm(arm)), _outputs([str(here)])


def _on_arm(program: Path) -> list[str]:
    return [QEMU, "-L", str(SYSROOT), str(program)]


class Stream:
    """native_harness.c's next_value."""

    def __init__(self):
        self.state = 12345

    def __call__(self, count: int) -> torch.Tensor:
        values = []
        for _ in range(count):
            self.state = (self.state * 6364136223846793005 + 1442695040888963407) % 2**64
            values.append((self.state >> 40) / 2**23 - 1.0)
        return torch.tensor(values, dtype=torch.float64)


def _references() -> dict[str, torch.Tensor]:
    """What native_harness.c computes, in float64 from the same inputs; for f32 and f64,
    drawn in the harness's order."""
    want, _stream = {}, Stream()
    for suffix in ("f32", "f64"):
        q, k = _stream(NB * M * D).view(NB, M, D), _stream(NB * N * D).view(NB, N, D)
        ds = _stream(NB * M * N).view(NB, M, N)
        _stream(NB * M * 3)  # the output accumulator, which the step zeroes (no max before)
        sign = torch.sign(q[:, :, None] - k[:, None])
        scores = -(q[:, :, None] - k[:, None]).abs().sum(-1)
        want[f"l1_scores_{suffix}"] = scores
        want[f"l1_dq_{suffix}"] = -(ds[..., None] * sign).sum(2)
        want[f"l1_dk_{suffix}"] = (ds[..., None] * sign).sum(1)
        allowed = torch.arange(M * N).view(M, N) % 3 != 0
        row_max = scores.masked_fill(~allowed, -torch.inf).amax(-1, keepdim=True)
        p = torch.exp(scores - row_max).masked_fill(~allowed, 0)
        want[f"softmax_p_{suffix}"], want[f"softmax_max_{suffix}"] = p, row_max
        want[f"softmax_sum_{suffix}"] = p.sum(-1, keepdim=True)
        want[f"softmax_grad_{suffix}"] = p * (ds - p.sum(-1, keepdim=True))
        target = torch.tensor([(e * 7) % NODES for e in range(E)])
        source = torch.tensor([(e * 5 + e // NODES) % NODES for e in range(E)])
        qn = _stream(NB * NODES * HEADS * D).view(NB, NODES, HEADS, D).requires_grad_()
        kn = _stream(NB * NODES * D).view(NB, NODES, 1, D).requires_grad_()
        ge = _stream(NB * E * HEADS).view(NB, E, HEADS)
        qe, ke = qn[:, target], kn[:, source]
        for kind, value in zip((TermKind.DOT, TermKind.SQDIST, TermKind.L1),
                               [(qe * ke).sum(-1), -((qe - ke) ** 2).sum(-1),
                                -(qe - ke).abs().sum(-1)], strict=True):
            name = f"edge{int(kind)}"  # the harness names each by the kind's value
            want[f"{name}_scores_{suffix}"] = value.detach()
            dq, dk = torch.autograd.grad(value, (qn, kn), ge, retain_graph=True)
            want[f"{name}_dq_{suffix}"], want[f"{name}_dk_{suffix}"] = dq, dk
    return {name: value.detach().reshape(-1) for name, value in want.items()}


def _close(got: torch.Tensor, want: torch.Tensor, name: str, f32_tol: float) -> None:
    """Within ``f32_tol`` (float32) or 1e-13 (float64) of the values' size."""
    size = want.abs().max().clamp_min(1.0)
    tol = 1e-13 if name.endswith("f64") else f32_tol
    assert ((got - want).abs() <= tol * size).all(), (name, float((got - want).abs().max()))


def test_aarch64_build_matches_this_machines_and_float64(runs):
    arm, here = runs
    assert arm["vector_bytes"] == 16  # NEON's registers
    assert arm.keys() == here.keys()
    assert torch.equal(arm.pop("team"), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    here.pop("team")
    want = _references()
    assert {k for k in arm if k != "vector_bytes"} == set(want)
    # Against float64: float32 sums of up to 70 terms, and the softmax of float32 scores of
    # size 46 (a score's rounding, 4e-6, is a weight's relative error). Between the builds
    # only the order of the sums differs.
    for name, value in want.items():
        _close(arm[name], value, name, 1e-5)
        _close(here[name], value, name, 1e-5)
        _close(arm[name], here[name], name, 1e-6)


def _generated_sources() -> list[str]:
    """The C a user's similarity term and score modifier generate, for float and double."""
    return [source for dtype in (torch.float32, torch.float64) for source in (
        c_target._source(trace_term(term, Graph("cpu", 6)), dtype, None),
        c_mod._source(trace_score_mod(UserScoreMod(mod), Graph("cpu")), set(), dtype))]


def test_generated_loops_cross_compile_without_warnings(tmp_path):
    """They take the portable vectors. Their functions take every slot whether the term reads
    it or not: unused parameters are no warning here."""
    for i, source in enumerate(_generated_sources()):
        path = tmp_path / f"generated{i}.c"
        path.write_text(source)
        _run([CROSS, *FLAGS, *WARNINGS, "-Wno-unused-parameter", "-c", str(path),
              "-o", str(path.with_suffix(".o"))])


@pytest.mark.parametrize("products", ["bf16", "fp32"])
def test_the_flash_engine_builds_its_stub(tmp_path, products):
    """Without AVX-512 the flash engine's source builds warning-free and says it has no
    kernel: flash_available() = 0, the exit status here."""
    main = tmp_path / "main.c"
    main.write_text("#include <stdint.h>\nint64_t flash_available(void);\n"
                    "int main(void) { return (int)flash_available() + 10; }\n")
    program = tmp_path / "flash"
    _run([CROSS, *FLAGS, *WARNINGS, *cpu_flash._FLAGS[products], str(ENGINES / "cpu_flash.c"),
          str(main), "-o", str(program), "-lm"])
    assert subprocess.run(_on_arm(program), timeout=300).returncode == 10
