"""Peak-memory measurement of one call, on CPU (process RSS) and CUDA (the caching allocator's stats).

CPU: the kernel's high-water mark VmHWM is reset by writing 5 to /proc/self/clear_refs. glibc keeps
freed memory for reuse, so a second call can show no growth: `pin_mmap_threshold` makes every
allocation above a small size its own mmap, returned to the OS on free, so a call that allocates
X MiB shows about X MiB. It also makes allocation slower, so time first, then pin, then measure memory.

Timing wants the opposite, `steady_allocator`: glibc's default moves its thresholds as blocks come
and go, so from one call to the next some of a call's buffers are handed back to the OS and faulted
in again (zeroed page by page) and some are reused — how many depends on the process's history,
not on the attention. Measured on a quiet 2-core machine, `linear` forward at N = 2048 took 4.3-4.7 ms
in calls without page faults and 8-10 ms in calls with 3,000 (12 MiB faulted in again), in one loop.
Pinned to glibc's own steady state (freed blocks below its largest mmap threshold are kept for reuse),
every call of a loop does the same work; blocks above it are mapped afresh on every call by any loop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re

import torch

M_MMAP_THRESHOLD = -3  # mallopt parameter numbers from glibc's malloc.h
M_TRIM_THRESHOLD = -1
PINNED_MMAP_THRESHOLD = 64 * 1024
STEADY_MMAP_THRESHOLD = (
    32 * 2**20
)  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), where its own adjustment stops
STEADY_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: in effect, never trim the heap's free top


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _set_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """glibc's mmap and trim thresholds (fixed: glibc stops adjusting them); False where glibc is absent."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return libc.mallopt(M_MMAP_THRESHOLD, int(mmap_bytes)) == 1 and libc.mallopt(M_TRIM_THRESHOLD, int(trim_bytes)) == 1


def pin_mmap_threshold(nbytes: int = PINNED_MMAP_THRESHOLD) -> bool:
    """Serve every allocation >= nbytes by mmap (and return it on free). False where glibc is absent."""
    ok = _set_thresholds(nbytes, nbytes)
    release_free_memory()  # what the heap already holds would otherwise be reused unseen
    return ok


def steady_allocator() -> bool:
    """Keep freed memory for reuse: every allocation below glibc's largest mmap threshold comes from the
    heap and goes back to it, never to the OS (no page faults from one call to the next once warmed).
    What timing is measured under; False where glibc is absent."""
    return _set_thresholds(STEADY_MMAP_THRESHOLD, STEADY_TRIM_THRESHOLD)


def release_free_memory() -> None:
    """Give the heap's free memory back to the OS (glibc malloc_trim), so reuse cannot hide growth."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field} field")
    return int(match.group(1))


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def measure_peak(fn, device: torch.device) -> dict:
    """Run fn() once; return {'peak_bytes': extra peak over the state before, 'reserved_bytes': CUDA only,
    'kind': what was measured: 'rss' (CPU: the process's resident-set high-water mark) or 'allocator'
    (CUDA: the caching allocator's peak of allocated bytes)}."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        base_reserved = torch.cuda.memory_reserved(device)
        fn()
        torch.cuda.synchronize(device)
        return {
            "peak_bytes": torch.cuda.max_memory_allocated(device) - base,
            "reserved_bytes": torch.cuda.max_memory_reserved(device) - base_reserved,
            "kind": "allocator",
        }
    release_free_memory()
    base = rss_bytes()
    reset_peak_rss()
    fn()
    return {"peak_bytes": max(0, peak_rss_bytes() - base), "reserved_bytes": None, "kind": "rss"}
