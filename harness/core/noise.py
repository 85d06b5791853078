"""Is the machine quiet enough to time on? CPU time other processes took while a cell was measured.

pyperf's practice: measure the noise and say so ("the benchmark result may be unstable") rather
than report a number as if the machine were idle. On Linux the kernel's /proc/stat gives the
whole machine's busy CPU time; subtracting this process's own (getrusage) leaves the others'.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

MIN_WINDOW_S = 0.2  # /proc/stat counts in 10 ms ticks: shorter windows are extended (idle) to this length
BUSY_CORES = 0.25  # other processes using more than this many cores on average: the cell is flagged
MAX_SPREAD = 0.10  # IQR / median above this: the cell is flagged


def machine_busy_seconds() -> float | None:
    """CPU seconds all processes of the machine spent busy since boot (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in (fields + ["0"] * 8)[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Snapshot:
    wall: float
    busy: float | None
    own: float
    load: float

    @classmethod
    def now(cls) -> "Snapshot":
        return cls(time.monotonic(), machine_busy_seconds(), own_cpu_seconds(), os.getloadavg()[0])

    def after(self) -> "Snapshot":
        """A snapshot at least MIN_WINDOW_S after this one (sleeping the rest: the others' load is what counts)."""
        rest = MIN_WINDOW_S - (time.monotonic() - self.wall)
        if rest > 0:
            time.sleep(rest)
        return Snapshot.now()


def others_cores(before: Snapshot, after: Snapshot) -> float | None:
    """Average number of cores other processes kept busy between two snapshots of this process."""
    if before.busy is None or after.busy is None or after.wall <= before.wall:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / (after.wall - before.wall))


def noise_fields(before: Snapshot, after: Snapshot, median: float, iqr: float, samples: int = 2) -> dict:
    """The row's noise record: load averages, other processes' cores, spread, and whether it is flagged.
    One sample has no spread (None): then only the other processes' load can flag it."""
    others = others_cores(before, after)
    spread = None if samples < 2 else iqr / median if median > 0 else 0.0
    reasons = []
    if others is not None and others > BUSY_CORES:
        reasons.append(f"other processes used {others:.2f} cores")
    if spread is not None and spread > MAX_SPREAD:
        reasons.append(f"spread (IQR/median) {spread:.0%}")
    return {
        "load_before": round(before.load, 2),
        "load_after": round(after.load, 2),
        "others_cores": None if others is None else round(others, 3),
        "spread": None if spread is None else round(spread, 4),
        "noisy": bool(reasons),
        "noise": "; ".join(reasons),
    }


def tree_cpu_seconds(roots: tuple[int, ...]) -> float:
    """CPU seconds of the processes `roots` and their live descendants, from /proc (0 where unreadable)."""
    if not roots or not os.path.isdir("/proc"):
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    tree = {pid for pid in roots if pid in times}
    while True:
        grown = {pid for pid, parent in parents.items() if parent in tree} - tree
        if not grown:
            return sum(times[pid] for pid in tree)
        tree |= grown


def machine_busy(seconds: float = 0.3, exclude: tuple[int, ...] = ()) -> str | None:
    """Why the machine is too busy to time on right now (sampled over `seconds`), or None.
    exclude: processes of this run (the fork server importing torch) whose CPU time is not "other"."""
    before, ours = Snapshot.now(), tree_cpu_seconds(exclude)
    time.sleep(seconds)
    after = Snapshot.now()
    after.own += tree_cpu_seconds(exclude) - ours
    others = others_cores(before, after)
    if others is not None and others > BUSY_CORES:
        return f"other processes are using {others:.1f} CPU cores (1-minute load average {os.getloadavg()[0]:.2f})"
    return None
