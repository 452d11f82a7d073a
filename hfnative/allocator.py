"""Host-memory allocator settings for training on CPU.

PyTorch allocates CPU tensors with ``malloc``. glibc serves requests above its mmap threshold (which
it raises dynamically up to 32 MiB) with fresh ``mmap`` pages and unmaps them on free, and it trims
the top of the heap whenever more than 128 KiB there is free. A training step allocates and frees the
same large tensors every step (the [chunk, vocab] logits of the loss, the [vocab, hidden] head
gradient, optimizer temporaries), so with the defaults every step pays the kernel's page faults and
zeroing for them again: measured ~6% of the step on the reference SFT benchmark (2 cores, fp32).

``keep_freed_cpu_memory`` raises both thresholds so freed blocks stay in the process and are reused
the next step. Peak RSS does not grow from it (the peak is the live set plus what the allocator keeps;
measured within 2% either way); what changes is that RSS stays near its peak after the peak instead
of falling back - the usual trade of a caching allocator, as on GPU.

Set ``HFNATIVE_KEEP_FREED_CPU_MEMORY=0`` to leave glibc's defaults alone. On a C library other than
glibc (musl, macOS, Windows) this does nothing.

The tensor pool. With the heap kept, what is left above the live set is the heap's free space: holes between
blocks still in use, which a later request of another size splits or cannot use. The interpreter's and libraries'
small objects (autograd nodes, tensor headers, Python containers) come from the same heap as the tensors and land in
those holes too. At 100M parameters, distillation's heap held 370-510 MiB free at its peak.
``pool_cpu_tensors`` makes torch's CPU allocator a small compiled one (``_cpu_pool.cpp``, built once with the
system's C++ compiler against the installed torch's headers and cached): tensors of 1 MiB and more get page-aligned
blocks of their own address range (best fit, split, coalesced, freed blocks kept for reuse; more than 1 GiB free
at the range's end goes back to the kernel); smaller ones still come from ``malloc``. Only tensor storage is there,
so nothing else pins its holes. Measured (2-core Xeon, 100M-parameter distillation, 4 steps): peak RSS 3,535 MiB
against 3,950-4,007 with the heap alone, the same losses to the last bit, no slower. ``heap_stats`` counts the
pool's bytes with the heap's.

The pool is opt-in: the trainer installs it when ``HFNATIVE_CPU_TENSOR_POOL=1``. A preloaded general allocator does
nearly as well for memory and can be faster (``benchmarks/bench_allocators.py``, benchmarks/RESULTS.md, 2026-12-05:
tcmalloc's peak RSS 1-2% above the pool's at 4-11% more tokens/s, jemalloc's within 1.4% at 8-11% fewer), so
``LD_PRELOAD`` of tcmalloc or jemalloc, as PyTorch's CPU performance guidance has it, is the first choice (see the
README). ``HFNATIVE_CPU_TENSOR_POOL=0`` keeps even a direct ``pool_cpu_tensors()`` call from installing it; without a
C++ compiler, on a system other than Linux, or where the build fails, the pool is not installed (logged once) and
nothing else changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from hfnative.switches import switched_off, switched_on

__all__ = ["HeapStats", "heap_stats", "keep_freed_cpu_memory", "pool_cpu_tensors", "pool_requested"]

logger = logging.getLogger(__name__)

ENV_SWITCH = "HFNATIVE_KEEP_FREED_CPU_MEMORY"
# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# requests up to 1 GiB come from the heap; larger ones are rare enough to map each time
_THRESHOLD_BYTES = 1 << 30

_applied: bool | None = None


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapStats(NamedTuple):
    """glibc's ``mallinfo2`` with the tensor pool's counts, in bytes: ``heap`` the size of the heap arenas (and the
    pool's resident range), ``mapped`` the blocks served by their own mmap, ``in_use`` the bytes handed out and not
    freed (in the arenas + mapped + the pool's blocks)."""

    heap: int
    mapped: int
    in_use: int


@functools.cache
def _glibc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it
        libc.mallopt
    except (OSError, AttributeError):
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _Mallinfo2
    return libc


def heap_stats() -> HeapStats | None:
    """The C library's allocation counters now, with the tensor pool's once it is installed; None where the C library
    is not glibc >= 2.33 (no ``mallinfo2``)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    heap, in_use = info.arena, info.uordblks + info.hblkhd
    pool = _pool_stats()
    if pool is not None:  # the tensor pool's resident range counts as heap, its blocks handed out as in use
        heap, in_use = heap + pool[1], in_use + pool[0]
    return HeapStats(heap=heap, mapped=info.hblkhd, in_use=in_use)


def keep_freed_cpu_memory() -> bool:
    """Once per process: keep freed heap memory for reuse (see the module docstring).

    Returns whether the setting is in effect (False when switched off or not on glibc).
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if switched_off(ENV_SWITCH):
        return False
    libc = _glibc()
    if libc is None:
        return False
    # the mmap threshold first: setting either one stops glibc's dynamic adjustment of both
    _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD_BYTES)
    )
    return _applied


# --- the tensor pool ------------------------------------------------------------------------------------------------

POOL_SWITCH = "HFNATIVE_CPU_TENSOR_POOL"
_POOL_SOURCE = Path(__file__).with_name("_cpu_pool.cpp")
_POOL_MIN_BYTES = 1 << 20  # smaller tensors stay with malloc
_POOL_RELEASE_BYTES = 1 << 30  # as the heap's trim threshold above
_pool_library = None
_pool_applied: bool | None = None


def _pool_cache_dir() -> Path:
    root = os.environ.get("HFNATIVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hfnative")
    return Path(root)


def _build_pool() -> Path:
    """The pool's shared library for this torch: built into the cache on first use (a second process finds it)."""
    import torch

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++ on PATH, or CXX)")
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-std=c++17", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}"]
    links = [f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    source = _POOL_SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), str(torch_dir).encode(), compiler.encode(),
                                      " ".join(flags + links).encode()])).hexdigest()[:16]
    for folder in (_pool_cache_dir(), Path(tempfile.gettempdir()) / f"hfnative-{os.getuid()}"):
        library = folder / f"cpu_pool-{key}.so"
        if library.exists():
            return library
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if not os.access(folder, os.W_OK):
            continue
        partial = folder / f".cpu_pool-{key}.{os.getpid()}.so"
        done = subprocess.run([compiler, *flags, str(_POOL_SOURCE), *links, "-o", str(partial)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"{compiler} failed: {(done.stderr or done.stdout).strip()[-2000:]}")
        os.replace(partial, library)  # whole or not at all, whichever process finishes first
        return library
    raise RuntimeError(f"no writable folder for the build ({_pool_cache_dir()}; set HFNATIVE_CACHE_DIR)")


def _pool_stats() -> tuple[int, int, int] | None:
    """(bytes handed out, bytes resident, bytes in free blocks) of the tensor pool; None when it is not installed."""
    if _pool_library is None:
        return None
    out = (ctypes.c_size_t * 3)()
    _pool_library.hfnative_cpu_pool_stats(out)
    return out[0], out[1], out[2]


def _reserve_bytes() -> int:
    """Address space for the pool: twice the machine's memory (no memory is taken by reserving it)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = 64 << 30
    return max(2 * physical, 4 << 30)


def pool_requested() -> bool:
    """Whether the run asks for the tensor pool (``HFNATIVE_CPU_TENSOR_POOL=1``): the trainer installs it only then."""
    return switched_on(POOL_SWITCH)


def pool_cpu_tensors() -> bool:
    """Once per process: CPU tensors of 1 MiB and more from the tensor pool (see the module docstring).

    Returns whether the pool is in effect (False when switched off, not on Linux, or the build failed: logged)."""
    global _pool_library, _pool_applied
    if _pool_applied is not None:
        return _pool_applied
    _pool_applied = False
    if switched_off(POOL_SWITCH) or not sys.platform.startswith("linux"):
        return False
    try:
        library = ctypes.CDLL(str(_build_pool()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.info("CPU tensor pool not installed, torch's CPU allocator stays: %s", error)
        return False
    library.hfnative_cpu_pool_install.argtypes = [ctypes.c_size_t] * 3
    library.hfnative_cpu_pool_install.restype = ctypes.c_int
    library.hfnative_cpu_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
    if not library.hfnative_cpu_pool_install(_reserve_bytes(), _POOL_MIN_BYTES, _POOL_RELEASE_BYTES):
        logger.info("CPU tensor pool not installed: its address range could not be reserved")
        return False
    _pool_library = library
    _pool_applied = True
    return True
