"""Native CPU kernels: C sources in kernels/, built with the system C compiler at first use
and called through ctypes (no torch headers, so a build takes about a second).

Invariants:
  * optional: ``paged_decode_kernel()`` returns None when there is no compiler, the build
    or the load fails, or ``KVSCOPE_CPU_ATTENTION=torch`` is set (A/B runs); callers then
    take their torch path. The reason is logged once;
  * a built library is cached under ``$KVSCOPE_HOME/native`` (default ~/.cache/kvscope),
    named by a hash of the source, the flags, the compiler and the CPU model (built with
    ``-march=native``), written to a temporary name and renamed, so concurrent processes
    (tensor-parallel workers) never load a half-written file;
  * the library links libgomp.so.1, which torch has already loaded: the dynamic loader
    reuses it, so the kernel and torch share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
PREFILL_SOURCE = Path(__file__).with_name("cpu_paged_prefill.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11",
         "-fno-strict-aliasing", "-fno-math-errno")
# KVSCOPE_CPU_ATTENTION=torch forces the torch ops path (the A/B baseline).
ENV_BACKEND = "KVSCOPE_CPU_ATTENTION"
PAGE_DTYPES = (torch.float32, torch.bfloat16)


def _cache_dir() -> Path:
    home = os.environ.get("KVSCOPE_HOME") or Path.home() / ".cache" / "kvscope"
    return Path(home) / "native"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, source_path: Path) -> Path:
    # the source and every header beside it (kernels/*.h, which the sources include)
    source = b"".join(p.read_bytes() for p in
                      [source_path, *sorted(source_path.parent.glob("*.h"))])
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), str(version).encode(),
                                     platform.machine().encode(), _cpu_model().encode()]))
    out = _cache_dir() / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, str(source_path), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load_library(source_name: str) -> ctypes.CDLL | None:
    """kernels/<source_name> built (or found in the cache) and loaded, or None (reason
    logged once) when there is no compiler or the build or the load fails. The caller sets
    the functions' argtypes."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s not built, using torch ops (slower)", source_name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, Path(__file__).with_name(source_name))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("native CPU kernels %s unavailable (%s): using torch ops", source_name, exc)
        return None


@functools.cache
def paged_decode_kernel() -> ctypes.CDLL | None:
    """The built decode kernel, or None (reason logged once) when it cannot be used."""
    if os.environ.get(ENV_BACKEND, "").lower() == "torch":
        log.info("%s=torch: CPU decode attention uses torch ops", ENV_BACKEND)
        return None
    lib = load_library(SOURCE.name)
    if lib is None:
        return None
    fn = lib.kvscope_paged_decode
    fn.restype = ctypes.c_int
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [p, i64, i, p, p, i, p, p, i64, i64, p, p, i64, p, i, i, i, i, i,
                   ctypes.c_float, i64, p, i, i]
    return lib


def supports(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel can read these pages in place: plain (unscaled) float32 or
    bfloat16 pages, contiguous, on the CPU."""
    return (k_cache.device.type == "cpu" and k_cache.dtype in PAGE_DTYPES and
            v_cache.dtype == k_cache.dtype and k_cache.is_contiguous() and
            v_cache.is_contiguous() and paged_decode_kernel() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                 new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 out_dtype: torch.dtype = torch.float32,
                 window: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [S, Hq, D] (float32 or bfloat16, read in place when
    each row's heads are contiguous) -> [S, Hq, D] in ``out_dtype`` (float32 or bfloat16).

    ``window``: a sliding window of W >= 1 keys: each query attends only its sequence's last
    W keys, and only the pages from the one holding the first of them are read.

    ``new_kv`` = (k, v, slots): each sequence's new key and value rows [S, Hkv, D] in the
    page dtype (heads contiguous; rows may be strided, as views into the fused qkv) and
    their flat slots [S] int64, written to the pages before attending (one call instead of
    a cache write and an attention per layer).

    ``block_tables`` [S, P] and ``seq_lens`` [S] int64, contiguous, already validated
    (every length >= 1 and within its table, every used block id < num_blocks, every slot
    < num_blocks * block_size): the kernel trusts them. Caches as ``supports`` requires."""
    lib = paged_decode_kernel()
    assert lib is not None and block_tables.dtype == seq_lens.dtype == torch.int64
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if q.dtype not in PAGE_DTYPES or not rows_of_contiguous_heads(q):
        q = q.to(torch.float32).contiguous()
    num_seqs, num_q_heads, head_dim = q.shape
    out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=out_dtype)
    k_ptr = v_ptr = slots_ptr = None
    k_stride = v_stride = 0
    if new_kv is not None:
        k, v, slots = new_kv
        assert k.dtype == v.dtype == k_cache.dtype and slots.dtype == torch.int64
        assert rows_of_contiguous_heads(k) and rows_of_contiguous_heads(v)
        assert slots.is_contiguous() and slots.shape == (num_seqs,)
        k_ptr, v_ptr, slots_ptr = k.data_ptr(), v.data_ptr(), slots.data_ptr()
        k_stride, v_stride = k.stride(0), v.stride(0)
    rc = lib.kvscope_paged_decode(
        q.data_ptr(), q.stride(0), int(q.dtype == torch.bfloat16), k_cache.data_ptr(),
        v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), k_ptr, v_ptr, k_stride,
        v_stride, slots_ptr, block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), num_seqs, num_q_heads, k_cache.shape[2], head_dim,
        k_cache.shape[1], scale, window or 0, out.data_ptr(), int(out_dtype == torch.bfloat16),
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError("native CPU decode kernel could not allocate its scratch buffers")
    return out


@functools.cache
def paged_prefill_kernel() -> ctypes.CDLL | None:
    """The built prefill kernel (kernels/cpu_paged_prefill.c), or None (reason logged once)
    when it cannot be used; as ``paged_decode_kernel``."""
    if os.environ.get(ENV_BACKEND, "").lower() == "torch":
        return None
    lib = load_library(PREFILL_SOURCE.name)
    if lib is None:
        return None
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.kvscope_paged_prefill_supported.restype = i
    lib.kvscope_paged_prefill_supported.argtypes = [i, i]
    fn = lib.kvscope_paged_prefill
    fn.restype = i
    fn.argtypes = [p, i64, p, p, i, p, i64, p, p, p, i, i, i, i, i, ctypes.c_float, i64, p, i,
                   i]
    return lib


def supports_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether ``paged_prefill`` can attend these queries over these pages: q of the pages'
    dtype with contiguous heads, pages as ``supports`` requires, and a build whose CPU has
    the instructions for this dtype and head size (AVX-512; AVX512-BF16 for bfloat16)."""
    return (q.dtype == k_cache.dtype and rows_of_contiguous_heads(q) and
            supports(k_cache, v_cache) and
            _prefill_builds_for(q.dtype == torch.bfloat16, q.shape[2]))


@functools.cache
def _prefill_builds_for(is_bf16: bool, head_dim: int) -> bool:
    """Whether this build of the prefill kernel has the instructions for the call."""
    lib = paged_prefill_kernel()
    return lib is not None and bool(lib.kvscope_paged_prefill_supported(int(is_bf16), head_dim))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, spans: torch.Tensor, scale: float,
                  out: torch.Tensor, window: int | None = None) -> None:
    """Causal attention of each prefill's query rows over its keys in the pages, written
    into those rows of ``out`` [T, Hq, D] (contiguous, float32 or bfloat16); ``window``: a
    sliding window of W >= 1 keys (each query sees only the last W of its keys; key blocks
    wholly before a sequence's first window are not read).

    ``spans`` [3, S] int64 contiguous: the prefills' first query rows, query row counts and
    key counts; prefill s's query i sees keys < keys - query rows + i + 1 (cached context,
    then causal);
    ``block_tables`` [S, P] int64 contiguous, one row per prefill. Already validated, as
    ``paged_decode``'s; the pages already hold every key (the step wrote them). Arguments as
    ``supports_prefill`` requires."""
    lib = paged_prefill_kernel()
    assert lib is not None and block_tables.dtype == spans.dtype == torch.int64
    assert spans.is_contiguous() and block_tables.is_contiguous()
    assert out.is_contiguous() and out.shape == q.shape and out.dtype in PAGE_DTYPES
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    starts, q_lens, seq_lens = spans
    rc = lib.kvscope_paged_prefill(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.dtype == torch.bfloat16), block_tables.data_ptr(), block_tables.stride(0),
        starts.data_ptr(), q_lens.data_ptr(), seq_lens.data_ptr(), spans.shape[1],
        num_q_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, window or 0,
        out.data_ptr(),
        int(out.dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("native CPU prefill kernel could not allocate its buffers" if rc == -1
                          else "native CPU prefill kernel cannot run this call in this build")


def rows_of_contiguous_heads(x: torch.Tensor) -> bool:
    """[S, H, D] whose every row holds its H * D elements contiguously (row stride free)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
