"""A sweep's life: open it (a new run, or one to resume), its devices, budgets and machine record, the
lock while its cells run, the failed cells measured again, the cluster closed at the end.

`bench run` is `open_sweep`, then `SweepSession.run` under a progress bar, then the report; everything
that decides what a run is or does lives here, the command line only shows it.

    with open_sweep(SweepRequest(build=dict(variants="full,linear", lengths=(256, 512), ...))) as session:
        rows = session.run(on_row=...)
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, ContextManager

from harness import policy
from harness.core import isolation
from harness.core.noise import machine_busy
from harness.options import ArgumentError, check_number, parse_resources
from harness.store import rundir
from harness.store.rows import run_rows
from harness.store.storage import RESULTS, SUPERSEDED, RunLock
from harness.sweep import runner
from harness.sweep.machines import current_device_names, measure_cluster, measure_machine
from harness.sweep.config import Cell, RunConfig
from harness.sweep.executors import EXECUTORS, LocalExecutor
from harness.sweep.plan import build_run_config
from harness.sweep.ray_executor import RayExecutor


def make_executor(
    name: str, *, device_names: dict | None = None, address: str | None = None, resources: dict | None = None
):
    """The executor called `name`; ValueError naming the allowed ones otherwise."""
    if name == "local":
        return LocalExecutor(device_names)
    if name == "ray":
        return RayExecutor(address=address, resources=resources or {})
    raise ValueError(f"--executor: {name!r} is not an executor; use one of: {', '.join(EXECUTORS)}")


def resume_hint(run_dir: Path, imports, on_ray: bool, address: str | None, resources: list[str]) -> str:
    """The command that finishes an interrupted sweep, on the executor (and cluster) it ran on."""
    again = rundir.resume_command("sweep", run_dir, imports)
    if on_ray:
        again += " --executor ray" + (f" --ray-address {address}" if address else "")
        again += "".join(f" --ray-resources {text}" for text in resources)
    return again


@dataclass(frozen=True)
class SweepRequest:
    """What `bench run` was asked, as checked command-line values. `build`: build_run_config's arguments
    for a new run (ignored when resuming: a run keeps its original options)."""

    build: dict = field(default_factory=dict)
    resume: Path | None = None
    out: Path | None = None
    imports: tuple[str, ...] = ()
    memory_budget: str = "auto"
    peak_time: float = 1.0
    executor: str = "local"
    ray_address: str | None = None
    ray_resources: tuple[str, ...] = ()
    retry_failed: bool = False


Say = Callable[[str], None]
Status = Callable[[str], ContextManager]


@dataclass
class SweepSession:
    """An open sweep: its directory (created with its metadata, or resumed), configuration, the hardware
    names its rows are measured on, and where its cells run (None: this machine)."""

    request: SweepRequest
    run_dir: Path
    config: RunConfig
    device_names: dict | None
    cluster: object | None
    say: Say = print

    @property
    def resumed(self) -> bool:
        return self.request.resume is not None

    @property
    def resume_command(self) -> str:
        r = self.request
        return resume_hint(
            self.run_dir, self.config.imports, self.cluster is not None, r.ray_address, list(r.ray_resources)
        )

    def kept(self) -> str:
        """What an interruption keeps: the finished cells and where they are."""
        done = run_rows(self.run_dir, self.config, self.device_names, quiet=True)
        return f"{len(done)} finished cells are kept in {self.run_dir / RESULTS}"

    def todo(self) -> list[Cell]:
        return runner.todo_cells(self.config, self.run_dir, self.device_names)

    def run(
        self,
        on_row: Callable[[Cell, dict | None], None] | None = None,
        before: Callable[[list[Cell]], None] | None = None,
    ) -> list[dict]:
        """Every cell without a row, under the run's lock (storage.RunDirBusy when another process holds
        it); with --retry-failed, the failed cells' rows set aside first. `before(todo)` is called with
        the cells left to run once the lock is held. Returns every row of the run."""
        with RunLock(self.run_dir):
            if self.request.retry_failed:
                moved = runner.retry_failed(self.run_dir, self.config, self.device_names)
                self.say(
                    f"--retry-failed: {moved} rows of failed cells set aside in {self.run_dir / SUPERSEDED}; measuring them again"
                )
            if before is not None:
                before(self.todo())
            return runner.sweep(
                self.config, self.run_dir, on_row=on_row, device_names=self.device_names, executor=self.cluster
            )

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None

    def __enter__(self) -> "SweepSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_sweep(request: SweepRequest, say: Say = print, status: Status = lambda text: nullcontext()) -> SweepSession:
    """Open the sweep `request` asks for. A new run is checked whole (every value, variant and option),
    then the machine is measured, and only then is its directory created: a refused or interrupted
    start-up writes nothing. ArgumentError for a value that is not allowed (the message names it)."""
    if request.executor not in EXECUTORS:
        raise ArgumentError(f"--executor: {request.executor!r} is not an executor; use one of: {', '.join(EXECUTORS)}")
    if request.retry_failed and request.resume is None:
        raise ArgumentError("--retry-failed goes with --resume RUN_DIR")
    if request.executor == "local" and (request.ray_address or request.ray_resources):
        raise ArgumentError("--ray-address and --ray-resources go with --executor ray")
    if request.executor == "local":
        isolation.start_fork_server()  # its imports overlap this process's own
    check_number("--peak-time", request.peak_time, 0, 60, "seconds", low_inclusive=False)
    resources = parse_resources(list(request.ray_resources))
    metadata = (
        rundir.open_to_resume(request.resume, "sweep", list(request.imports)) if request.resume is not None else None
    )
    cluster = _start_cluster(request.ray_address, resources, say, status) if request.executor == "ray" else None
    try:
        if metadata is not None:
            config, run_dir, device_names = _resumed(request, metadata, cluster)
            _warn_if_busy(cluster, say)
            say(f"resuming {run_dir} with its original options (other options given now are ignored)")
        else:
            config, run_dir, device_names = _started(request, cluster, say, status)
    except BaseException:
        if cluster is not None:
            cluster.close()
        raise
    return SweepSession(request, run_dir, config, device_names, cluster, say)


def _resumed(request: SweepRequest, metadata: dict, cluster) -> tuple[RunConfig, Path, dict | None]:
    config = RunConfig.from_json(metadata["config"])
    policy.import_modules(list(config.imports))
    if not config.resolved_options:  # a run from before options were fixed at its start
        config = config.with_resolved_options()
    device_names = (metadata.get("machine") or {}).get("device_names")
    if cluster is None:
        rundir.check_same_devices(device_names, current_device_names(config.devices), request.resume)
    else:  # the cluster's hardware now: rows of hardware it no longer has stay in the file, unused
        device_names = cluster.device_names(config.devices)
    return config, request.resume, device_names


def _started(request: SweepRequest, cluster, say: Say, status: Status) -> tuple[RunConfig, Path, dict]:
    policy.import_modules(list(request.imports))
    kinds = None if cluster is None else tuple(kind for kind in ("cpu", "cuda") if cluster.devices(kind))
    config = build_run_config(**request.build, imports=list(request.imports), cluster=kinds)
    if request.memory_budget.strip() != "auto":  # a size is checked now; auto needs the machine, measured below
        policy.memory_budgets(request.memory_budget, config.devices, {})
    run_dir = rundir.new_run_dir(request.out)
    _warn_if_busy(cluster, say)
    # nothing is written until every value is known: an interrupted start-up leaves no directory
    with status("measuring the matmul peak" + (" on each kind of node" if cluster else " of this machine")):
        machine = (
            measure_machine(config, request.peak_time)
            if cluster is None
            else measure_cluster(config, cluster, request.peak_time)
        )
    budgets = policy.memory_budgets(request.memory_budget, config.devices, machine)
    config = replace(config, memory_budget=tuple(sorted(budgets)))
    rundir.start(run_dir, "sweep", config.to_json(), machine, policy.recorded_facts(config.variants))
    return config, run_dir, machine["device_names"]


def _warn_if_busy(cluster, say: Say) -> None:
    """On this machine (not a cluster's nodes): say so when other processes are using its cores now."""
    if cluster is not None:
        return
    pid = isolation.fork_server_pid()
    busy = machine_busy(exclude=(pid,) if pid else ())
    if busy:
        say(f"[yellow]warning[/]: {busy}; the benchmark result may be unstable (cells measured now are flagged)")


def _start_cluster(address: str | None, resources: dict, say: Say, status: Status):
    """The Ray executor, joined to its cluster (or a local instance); ArgumentError when it cannot be
    joined or has no node to run on."""
    where = f"the Ray cluster at {address}" if address else "a local Ray instance"
    try:
        with status(f"joining {where} and reading its nodes"):
            cluster = make_executor("ray", address=address, resources=resources)
    except RuntimeError as err:
        raise ArgumentError(str(err)) from None
    for node in cluster.node_records():
        gpus = f", {node['gpus']} x {node['gpu_name']}" if node["gpus"] else ""
        say(f"node {node['host']} ({node['ip']}): {node['cpus']} CPUs, {node['cpu_model']}{gpus}")
    if not cluster.node_records():
        cluster.close()
        raise ArgumentError(
            f"--executor ray: {where} has no alive node" + (" with the --ray-resources asked for" if resources else "")
        )
    return cluster
