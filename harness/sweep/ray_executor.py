"""`bench run --executor ray`: each cell a Ray task on a node of a cluster (or of a local Ray instance).

On its node the task runs the cell exactly as the local executor does (ray_node.py: a fresh child of the
node's fork server, the same gate, timing, memory, timeout and fault classification) and returns the outcome
with a record of the node. What is Ray's own:

- Placement. The driver probes every alive node once and groups nodes by hardware: a CPU cell takes a whole
  node (no two timed CPU cells share one), a CUDA cell one GPU. Each task is pinned to the node the driver
  chose; `--ray-resources` adds custom resources every cell must have.
- Faults. The cell's timeout is enforced on the node; the driver also cancels a task that has not answered
  within the timeout plus a start-up grace. A worker or node lost mid-cell is tried once more, then recorded
  as `error` with the reason; a cell that crashed its own process is never retried. Ray's OOM kill is `oom`.
  Ctrl-C cancels what is outstanding.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

from harness.core.isolation import Outcome
from harness.sweep.executors import CellCancelled
from harness.sweep.ray_node import node_record, ray_module, run_on_node

START_GRACE_S = 120.0  # a task's start on its node (a new worker, the fork server's imports) beyond the cell's timeout
CONNECT_TIMEOUT_S = 5.0


class RayJob:
    def __init__(self, call: tuple, group: tuple, deadline_s: float):
        self.call, self.group, self.deadline_s = call, group, deadline_s
        self.failed: Outcome | None = None  # set when no node of its hardware is left to run it
        self.ref = None
        self.node = None
        self.started = 0.0
        self.attempts = 0
        self.cancelled = False


class RayExecutor:
    """Cells as Ray tasks, pinned to nodes grouped by hardware; see the module's docstring."""

    name = "ray"
    parallel = True
    remote = True

    def __init__(self, address: str | None = None, resources: dict | None = None):
        self.ray = ray_module()
        self.resources = dict(resources or {})
        self.started_here = False
        self._connect(address)
        self._remote_task = self.ray.remote(run_on_node)
        self.nodes = self._probe_nodes()
        self._lock = threading.Condition()
        self._outstanding: set = set()
        self._closing = False
        self._slots_of = self._slots()  # (kind, device name) -> node ids, one entry per slot
        self._free = {group: list(slots) for group, slots in self._slots_of.items()}  # slots not running a cell
        self._lost: set = set()  # nodes that died under a cell: never given a cell again

    # connecting and probing
    def _connect(self, address: str | None) -> None:
        ray = self.ray
        if ray.is_initialized():
            return  # a driver that already joined a cluster (tests, notebooks): use it
        if address in (None, "", "local"):
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
            self.started_here = True
            return
        if address != "auto":
            _check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        except Exception as err:  # noqa: BLE001 — ConnectionError, RuntimeError, ... all mean: no cluster there
            raise RuntimeError(
                f"--ray-address: cannot join a Ray cluster at {address!r}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}"
            ) from None

    def _probe_nodes(self) -> list[dict]:
        """One record per alive node that has the cells' custom resources, read on that node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = self.ray.remote(node_record)
        refs = []
        for node in self.ray.nodes():
            have = node.get("Resources", {})
            if not node.get("Alive") or any(have.get(key, 0) < value for key, value in self.resources.items()):
                continue
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            refs.append(
                (have, probe.options(num_cpus=0, num_gpus=have.get("GPU", 0), scheduling_strategy=strategy).remote())
            )
        nodes = []
        for have, ref in refs:
            record = self.ray.get(ref, timeout=300)
            record["cpus"] = int(have.get("CPU", 0))
            record["gpus"] = int(have.get("GPU", 0))
            nodes.append(record)
        return nodes

    def _slots(self) -> dict[tuple, list]:
        slots: dict[tuple, list] = {}
        for node in self.nodes:
            if node["cpus"] > 0:
                slots.setdefault(("cpu", node["cpu_model"]), []).append(node["node_id"])
            for _ in range(node["gpus"]):
                slots.setdefault(("cuda", node["gpu_name"]), []).append(node["node_id"])
        return slots

    def devices(self, kind: str) -> dict:
        """{device name: slots} of the cluster for "cpu" or "cuda" (nodes without --ray-resources left out)."""
        return {
            name: len([n for n in ids if n not in self._lost]) for (k, name), ids in self._slots_of.items() if k == kind
        }

    def device_names(self, kinds) -> dict[str, list[str]]:
        """{kind: the cluster's hardware names for it, sorted}: what a run's plan measures each kind on
        (a GPU whose name could not be read is left out: its cells are skipped with the reason)."""
        return {kind: sorted(name for name in self.devices(kind) if name) for kind in kinds}

    def node_records(self) -> list[dict]:
        return list(self.nodes)

    # running cells
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
    ) -> RayJob:
        # the cell's own timeout is enforced on its node; this backstop is for a node that stops answering
        # (twice the timeout: a CUDA cell may wait for a CPU cell holding its node's CPUs)
        job = RayJob(
            (fn, args, timeout, tuple(imports), log_path, device), (device, device_name), 2 * timeout + START_GRACE_S
        )
        self._start(job)
        return job

    def _start(self, job: RayJob) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        fn, args, timeout, imports, _, device = job.call
        with self._lock:
            while not self._free.get(job.group):
                if self._closing or job.cancelled:
                    raise CellCancelled()
                if not [n for n in self._slots_of.get(job.group, []) if n not in self._lost]:
                    job.failed = Outcome(
                        "exception",
                        (
                            "NodeDiedError",
                            f"no node of the cluster with {job.group[0]} "
                            f"{job.group[1]!r} is left (lost: {len(self._lost)})",
                            False,
                        ),
                    )
                    return
                self._lock.wait(1.0)
            node_id = self._free[job.group].pop(0)
        node = next(n for n in self.nodes if n["node_id"] == node_id)
        record = {key: node[key] for key in ("node_id", "host", "ip", "cpu_model", "gpu_name", "torch", "cuda")}
        if device == "cuda":
            options = {"num_cpus": 1, "num_gpus": 1}
        else:
            options = {"num_cpus": node["cpus"], "num_gpus": 0}
        job.node, job.started, job.attempts = node_id, time.monotonic(), job.attempts + 1
        job.ref = self._remote_task.options(
            **options,
            resources=self.resources or None,
            max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote((fn.__module__, fn.__name__), args, timeout, imports, list(sys.path), record)
        with self._lock:
            self._outstanding.add(job)

    def _release(self, job: RayJob, lost: bool = False) -> None:
        """The job's slot is free again; or, when its node died under it, that node leaves every group."""
        with self._lock:
            self._outstanding.discard(job)
            if job.node is not None:
                if lost:
                    self._lost.add(job.node)
                    for group in self._free:
                        self._free[group] = [n for n in self._free[group] if n != job.node]
                elif job.node not in self._lost:
                    self._free[job.group].append(job.node)
                job.node = None
                self._lock.notify_all()

    def outcome(self, job: RayJob) -> tuple[Outcome, dict | None]:
        ray = self.ray
        exceptions = ray.exceptions
        while True:
            if job.cancelled:
                raise CellCancelled()
            if job.failed is not None:
                return job.failed, None
            ready, _ = ray.wait([job.ref], timeout=max(0.0, job.started + job.deadline_s - time.monotonic()))
            if job.cancelled:
                raise CellCancelled()
            if not ready:
                ray.cancel(job.ref, force=True)
                self._release(job)
                return Outcome("timeout"), None
            try:
                outcome, record, log = ray.get(job.ref)
            except exceptions.OutOfMemoryError as err:
                self._release(job)
                return Outcome(
                    "exception", ("OutOfMemoryError", f"Ray's memory monitor killed the task: {_first_line(err)}", True)
                ), None
            except (
                exceptions.WorkerCrashedError,
                exceptions.NodeDiedError,
                exceptions.LocalRayletDiedError,
                exceptions.ObjectLostError,
                exceptions.RaySystemError,
            ) as err:
                self._release(job, lost=True)
                if job.attempts < 2:  # the node's failure, not the cell's: once more, on any node of the group
                    self._start(job)
                    continue
                return Outcome(
                    "exception",
                    (type(err).__name__, f"the node was lost twice running this cell: {_first_line(err)}", False),
                ), None
            except exceptions.TaskCancelledError:
                self._release(job)
                if job.cancelled:
                    raise CellCancelled() from None
                return Outcome("exception", ("TaskCancelledError", "the task was cancelled on its node", False)), None
            except exceptions.RayTaskError as err:  # the task's own code failed on the node (not the cell's)
                self._release(job)
                return Outcome(
                    "exception", (type(err).__name__, f"the task failed on its node: {_first_line(err)}", False)
                ), None
            self._release(job)
            log_path = job.call[4]
            if log and log_path:
                with open(log_path, "a") as handle:
                    handle.write(log)
            return outcome, record

    def cancel(self, job: RayJob) -> None:
        job.cancelled = True
        if job.ref is not None:
            try:
                self.ray.cancel(job.ref, force=True)
            except Exception:  # noqa: BLE001 — already finished or gone
                pass
        self._release(job)

    def cancel_all(self) -> None:
        with self._lock:
            self._closing = True
            jobs = list(self._outstanding)
        for job in jobs:
            self.cancel(job)

    def close(self) -> None:
        self.cancel_all()
        if self.started_here:
            self.ray.shutdown()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:500] if text else type(err).__name__


def _check_reachable(address: str) -> None:
    """RuntimeError within seconds when nothing listens at the address's host:port (ray.init would wait long)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(
            f"--ray-address: {address!r} is not an address; use host:port, ray://host:port, auto, or "
            f"leave it out to start a local Ray instance"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise RuntimeError(
            f"--ray-address: nothing answers at {target} ({err.strerror or err}); is the cluster's head "
            f"node running there?"
        ) from None
