"""Where a cell runs: the seam between the sweep, which decides cells and writes their rows, and the
process that measures one.

    executor.devices(kind)                   # {device name: slots} the executor can run `kind` cells on
    job = executor.submit(fn, args, device=..., device_name=..., timeout=..., imports=..., log_path=...)
    outcome, node = executor.outcome(job)    # blocks until the cell ended; node: where it ran (or None)
    executor.cancel(job)

`LocalExecutor` (the default) runs each cell in a fork-server child on this machine
(`harness.core.isolation`), one at a time. `RayExecutor` (`harness.sweep.ray_executor`) sends each cell as a Ray
task to a node of a cluster, where the same fork-server isolation runs it, so a row depends on the
hardware it ran on, never on the executor. Whatever runs where, only the sweep writes rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.core.isolation import Outcome, run_isolated

EXECUTORS = ("local", "ray")


class CellCancelled(Exception):
    """The cell's job was cancelled (Ctrl-C): it has no outcome, and no row is written for it."""


@dataclass
class LocalJob:
    fn: object
    args: tuple
    timeout: float
    imports: tuple
    log_path: str | None


class LocalExecutor:
    """Every cell on this machine, in a fresh child of the fork server, one after the other."""

    name = "local"
    parallel = False

    def __init__(self, device_names: dict | None = None):
        self.device_names = device_names or {}

    def devices(self, kind: str) -> dict:
        return {self.device_names.get(kind): 1}

    def submit(
        self,
        fn,
        args: tuple,
        *,
        device: str,
        device_name: str | None,
        timeout: float,
        imports: tuple = (),
        log_path: str | None = None,
    ) -> LocalJob:
        return LocalJob(fn, args, timeout, tuple(imports), log_path)

    def outcome(self, job: LocalJob) -> tuple[Outcome, dict | None]:
        return run_isolated(job.fn, job.args, timeout=job.timeout, imports=job.imports, log_path=job.log_path), None

    def cancel(self, job) -> None:
        pass  # the job runs inside outcome(): nothing is outstanding

    def close(self) -> None:
        pass
