"""The CPU kernel library: ``kernels.cpp`` beside this file, compiled once with the system C++ compiler.

The library holds the block products of :mod:`quant_linear`, the fused small ops of :mod:`fused` and
the whole decoder stack of short forwards (:mod:`layer_stack`).
It is plain C++ (no torch headers, so it compiles in about two seconds), built for AVX-512 (avx512f,
avx512bw, f16c, fma in /proc/cpuinfo; with avx512vl and avx512_vnni, VNNI's integer dot products) or
else AVX2 (avx2, f16c, fma, and avx_vnni where present: the same code on pairs of 8-float registers,
:data:`ISA_BUILDS`) into ``$FLASHTREE_CACHE/kernels``, cached by source, flags
and compiler, and called through ``ctypes``; its OpenMP loops run on the OpenMP runtime torch
already loaded, with torch's thread count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

from flashtree.paths import cache_root

SOURCE_FILE = Path(__file__).with_name("kernels.cpp")
CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mf16c", "-mfma")
# instruction sets the kernel is built for, best first: (name, CPU flags it needs, compiler flags)
# (the VNNI builds differ only in the int8-activation products' integer dot instruction: same values)
ISA_BUILDS = (("avx512-vnni", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"),
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
              ("avx512", ("avx512f", "avx512bw", "f16c", "fma"), ("-mavx512f", "-mavx512bw")),
              ("avx2-vnni", ("avx2", "avx_vnni", "f16c", "fma"), ("-mavx2", "-mavxvnni")),
              ("avx2", ("avx2", "f16c", "fma"), ("-mavx2",)))


class KernelUnavailable(RuntimeError):
    """Why the kernel library cannot run here (the torch ops are used instead)."""


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def find_compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def kernel_cache_dir() -> Path:
    return cache_root() / "kernels"


@functools.lru_cache(maxsize=None)
def load_kernels() -> ctypes.CDLL:
    """The compiled kernel library, built on first use and cached by source, flags and compiler.
    Raises :class:`KernelUnavailable` with the reason when it cannot be used here."""
    isa_flags = isa_compiler_flags(cpu_flags())
    compiler = find_compiler()
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX or install g++)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelUnavailable(f"{compiler} does not run ({err})") from None
    flags = (*CXX_FLAGS, *isa_flags)
    source = SOURCE_FILE.read_text()
    key = hashlib.sha256("\0".join([source, *flags, compiler, version]).encode()).hexdigest()[:16]
    library = kernel_cache_dir() / f"flashtree_block_kernels-{key}.so"
    if not library.is_file():
        build_library(compiler, library, flags, source)
    lib = ctypes.CDLL(str(library))
    lib.flashtree_block_gemm.restype = ctypes.c_int
    lib.flashtree_block_gemm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int]
    lib.flashtree_block_dequantize.restype = ctypes.c_int
    lib.flashtree_block_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                               ctypes.c_int64, ctypes.c_int]
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64  # the fused small ops (fused.py)
    lib.flashtree_add_rms_norm.restype = lib.flashtree_silu_mul.restype = None
    lib.flashtree_add_rms_norm.argtypes = [ptr] * 5 + [i64, i64, ctypes.c_float]
    lib.flashtree_silu_mul.argtypes = [ptr, ptr, i64, i64]
    lib.flashtree_qkv_rope_write.restype = lib.flashtree_tree_attention.restype = None
    lib.flashtree_qkv_rope_write.argtypes = [ptr] * 10 + [i64] * 5 + [ctypes.c_float] + [i64] * 3
    lib.flashtree_tree_attention.argtypes = [ptr] * 8 + [i64] * 6 + [ctypes.c_float] + [i64] * 5 + [ctypes.c_int]
    f32 = ctypes.c_float
    lib.flashtree_moe_route.restype = None  # (models/moe.py)
    lib.flashtree_moe_route.argtypes = [ptr] * 4 + [i64] * 4 + [ctypes.c_int, ctypes.c_int]
    lib.flashtree_moe_layer.restype = ctypes.c_int
    lib.flashtree_moe_layer.argtypes = [ptr] * 3 + [i64] * 2 + [ctypes.c_int]
    lib.flashtree_layer_stack.restype = ctypes.c_int  # (layer_stack.py)
    lib.flashtree_layer_stack.argtypes = ([ptr, i64, ptr, f32, f32, f32] + [ptr] * 5 + [i64] * 2 + [ptr] * 7
                                          + [i64] * 4 + [ptr] * 4 + [i64] * 4 + [ctypes.c_int, ptr, ptr, i64])
    return lib


def isa_compiler_flags(available: set[str]) -> tuple[str, ...]:
    """Compiler flags of the best instruction set in :data:`ISA_BUILDS` this CPU has (AVX-512, else
    AVX2); raises :class:`KernelUnavailable` naming what is missing when it has neither."""
    for _name, needed, flags in ISA_BUILDS:
        if all(flag in available for flag in needed):
            return flags
    missing = sorted(set(ISA_BUILDS[-1][1]) - available)  # what the least demanding build lacks
    raise KernelUnavailable(f"this CPU lacks {', '.join(missing)} (the kernel needs AVX-512 or AVX2 with F16C and FMA)")


def build_library(compiler: str, library: Path, flags: Sequence[str], source_text: str) -> None:
    """Compile into a private temporary file and rename it into place (concurrent builds are safe)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=library.parent) as tmp:
        source, output = Path(tmp) / "kernels.cpp", Path(tmp) / library.name
        source.write_text(source_text)
        try:
            result = subprocess.run([compiler, *flags, str(source), "-o", str(output)],
                                    capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            raise KernelUnavailable(f"{compiler} failed to run ({err})") from None
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise KernelUnavailable(f"{compiler} could not build the kernel: {detail[0] if detail else result.returncode}")
        os.replace(output, library)


def kernels_available() -> tuple[bool, str]:
    """(True, "") when the kernel is usable here, else (False, why)."""
    try:
        load_kernels()
    except (KernelUnavailable, OSError) as err:
        return False, str(err)
    return True, ""
