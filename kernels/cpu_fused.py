"""Small CPU ops fused into one C++ call each, built once per machine, or None.

At one decode row a CPU step is bound by dispatch: the torch references of the residual add +
RMSNorm, the rotary + cache write and SiLU·mul are 6-12 aten calls each over a narrow row, a
few microseconds apiece, and a 30-layer model makes ~100 of them a step; a quantized projection
casts its rows to bf16 and back around the kernel; the sampler's bitmask expands every bit to an
int32 before masking; and a float32 projection of a step's few rows (:mod:`kernels.cpu_linear`)
reads its weight once for all of them. ``kernels/csrc/cpu_fused.cpp`` does each in one call
(float32, row by row: a row's result never depends on the other rows). It is compiled with torch's C++ extension
builder the first time a machine asks (~25 s; needs a C++ compiler and ninja) and cached under
torch's extensions folder (``TORCH_EXTENSIONS_DIR``), so later processes load it in a fraction
of a second. Where it cannot be built (no compiler) or ``TRELLIS_CPU_KERNELS=0``,
:func:`cpu_fused_ops` returns None and the callers keep the torch references: the same results
to float32 rounding (the norm sums its squares in double, SiLU uses the C library's ``exp``),
the rotary, the casts and the bitmask bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_fused.cpp", "cpu_attention.cpp", "cpu_sampler.cpp")]
HEADERS = [Path(__file__).with_name("csrc") / "vector_exp.h"]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]  # OpenMP: at::parallel_for runs serial without it


def enabled() -> bool:
    """Whether the fused CPU ops may be used (``TRELLIS_CPU_KERNELS=0`` turns them off)."""
    return os.environ.get("TRELLIS_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


_BUILD_LOCK = threading.Lock()  # the engine's thread and the server's may ask at once


@functools.cache
def cpu_fused_ops() -> ModuleType | None:
    """The built extension (the layer ops, the quantized projections, the bitmask), or None."""
    if not enabled():
        return None
    with _BUILD_LOCK:
        try:
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()
            log.info("fused CPU ops: loading (built once per machine, ~25 s the first time)")
            return load(name=f"trellis_cpu_fused_{_machine_tag()}_{_source_tag()}",
                        sources=[str(source) for source in SOURCES], extra_cflags=FLAGS,
                        extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # no compiler, no ninja, a failed build: the references serve
            log.warning("fused CPU ops unavailable, using the torch references: %s", str(exc).splitlines()[0])
            return None


@functools.cache
def vectorised_cpu_ops() -> ModuleType | None:
    """The built extension where its kernels are the AVX-512 ones (the packed panels, the output
    attention, the sampler), else None (callers keep their torch routes)."""
    ops = cpu_fused_ops()
    return ops if ops is not None and ops.panel_kernel_vectorised() else None


def _machine_tag() -> str:
    """A short hash of the CPU's feature flags: the build is for this CPU (``-march=native``),
    and a home folder shared with another machine must not hand it a build it cannot run."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags or platform.machine() + platform.processor()).encode()).hexdigest()[:10]


def _source_tag() -> str:
    """A short hash of the sources and headers: torch's builder rebuilds when a source changes,
    not a header, so the name carries both (a changed header is a fresh build)."""
    digest = hashlib.sha1()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip package's binary sits in the venv's
    bin folder, which a venv's python run by path does not put there."""
    try:
        import ninja
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def fusable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors are what the fused ops take (float32 on the CPU)."""
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)  # is_cpu: no device object made
