"""`bench run --executor ray`: the same cells and statuses as the local executor, node records, faults,
resume after the driver is killed, and a simulated two-node cluster.

Ray is started once for the whole module: a cluster of two logical nodes of one CPU each on this
machine (`ray.cluster_utils.Cluster`), 2 CPUs in all. CLI calls in this process join it (the
executor uses a driver that is already connected); `bench` subprocesses join it by its address.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from harness.store.storage import read_metadata, read_rows  # noqa: E402
from helpers import FAST, SLOW_RUN, bench, bench_process, run_dir_rows, wait_for_rows  # noqa: E402

KEY = ["device", "variant", "pass", "causal", "n"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's memory monitor kills the newest task when the machine's memory is nearly full; what the suite's
    # other modules hold must not turn a cell here into an oom (the statuses asserted are the executor's own)
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    two = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    two.add_node(num_cpus=1)
    ray.init(address=two.address, log_to_driver=False, configure_logging=False)
    two.wait_for_nodes()
    yield two
    ray.shutdown()
    two.shutdown()


def cluster_config(variants: str, repeats: int, warmup: int):
    """A sweep of `variants` at N = 65..68, forward, on the cluster's CPUs (for runner.sweep called directly)."""
    import fault_variants  # noqa: F401 — registers test_slow
    from harness.sweep.plan import build_run_config

    return build_run_config(
        variants=variants,
        lengths=(65, 66, 67, 68),
        devices="cpu",
        passes="fwd",
        causal=(False,),
        options={},
        imports=["fault_variants"],
        min_time=0,
        cell_timeout=60,
        cluster=("cpu",),
        batch=1,
        heads=2,
        head_dim=16,
        dtype="float32",
        repeats=repeats,
        warmup=warmup,
        threads=0,
        check_len=32,
    )


def ray_bench(*args: str):
    return bench("run", "--executor", "ray", *args)


def test_same_cells_and_statuses_as_local_split_over_both_nodes(tmp_path, cluster):
    sweep = ["--variants", "full,linear", "--lengths", "32,64", "--passes", "fwd", *FAST]  # two series: one per node
    local, remote = tmp_path / "local", tmp_path / "ray"
    assert bench("run", *sweep, "--out", str(local)).exit_code == 0
    result = ray_bench(*sweep, "--out", str(remote))
    assert result.exit_code == 0, result.output
    a, b = run_dir_rows(local), run_dir_rows(remote)
    assert sorted(map(tuple, a[KEY + ["status"]].values.tolist())) == sorted(
        map(tuple, b[KEY + ["status"]].values.tolist())
    )
    assert set(b["status"]) == {"ok"} and not b.duplicated(KEY).any()
    nodes = {row["node_id"] for row in b["node"]}
    assert len(nodes) == 2, "the series ran in parallel on both logical nodes"
    for row in b["node"]:
        assert row["host"] and row["cpu_model"] == b["device_name"].iloc[0] and row["torch"]
    meta = read_metadata(remote)
    assert meta["machine"]["executor"] == "ray"
    assert {node["node_id"] for node in meta["machine"]["nodes"]} == nodes
    assert meta["machine"]["device_names"] == {"cpu": [b["device_name"].iloc[0]]}
    assert meta["machine"]["matmul_peak_gflops"]["cpu/float32"] > 0
    assert bench("report", str(remote)).exit_code == 0
    report = (remote / "REPORT.md").read_text()
    for node in meta["machine"]["nodes"]:
        assert node["node_id"][:8] in report  # the report lists both nodes and what ran on each


def test_faults_give_the_local_statuses_and_a_missing_device_is_skipped(tmp_path, cluster):
    out = tmp_path / "faults"
    result = ray_bench(
        "--import",
        "fault_variants",
        "--variants",
        "test_raises,test_hangs,test_kills_itself,test_segfaults,test_hog",
        "--lengths",
        "32,128,4096",
        "--passes",
        "fwd",
        "--cell-timeout",
        "8",
        "--memory-budget",
        "128MiB",
        "--devices",
        "cpu,cuda",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    everything = run_dir_rows(out)
    cuda = everything[everything["device"] == "cuda"]  # the cluster has no GPU: skipped with the reason, not hung
    assert len(cuda) == 15 and set(cuda["status"]) == {"skipped"}
    assert all("no node of the cluster has a cuda device" in message for message in cuda["message"])
    rows = everything[everything["device"] == "cpu"].set_index(["variant", "n"])
    for n in (32, 128):  # the cells that pass below the faults (a stall past the timeout shows here, named)
        for name in ("test_raises", "test_hangs", "test_kills_itself", "test_segfaults", "test_hog"):
            if n == 32 or name == "test_hog":
                assert rows.loc[(name, n), "status"] == "ok", (name, n, rows.loc[(name, n), "message"])
    # what tests/test_harness.py asserts of the local executor
    assert rows.loc[("test_raises", 32), "status"] == "ok"
    assert rows.loc[("test_raises", 128), "status"] == "error"
    assert "ValueError: deliberate failure" in rows.loc[("test_raises", 128), "message"]
    assert rows.loc[("test_hangs", 128), "status"] == "timeout"
    assert rows.loc[("test_kills_itself", 128), "status"] == "oom"
    assert "SIGKILL" in rows.loc[("test_kills_itself", 128), "message"]
    assert rows.loc[("test_segfaults", 128), "status"] == "error"
    assert "SIGSEGV" in rows.loc[("test_segfaults", 128), "message"]
    assert rows.loc[("test_hog", 4096), "status"] == "oom", rows.loc["test_hog"][
        ["status", "message"]
    ].to_dict()  # 256 MiB asked for, 128 MiB allowed
    # (64 MiB allowed, as tests/test_harness.py gives the local executor, left test_hog's 8 MiB at N = 128 refused
    # in 2 of 3 whole-suite runs on a Ray node at one stop: the cell's limit counts from its size when it starts)
    for name in ("test_hangs", "test_kills_itself"):
        assert rows.loc[(name, 4096), "status"] == "skipped"
        assert "series stopped at N=128" in rows.loc[(name, 4096), "message"]
    assert "deliberate failure" in (out / "worker.log").read_text()  # the nodes' logs reach the run's worker.log


def test_wrong_result_is_incorrect(tmp_path, cluster):
    out = tmp_path / "wrong"
    result = ray_bench(
        "--import",
        "fault_variants",
        "--variants",
        "test_wrong",
        "--lengths",
        "32",
        "--passes",
        "fwd",
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 1, result.output  # no cell ran successfully
    assert set(run_dir_rows(out)["status"]) == {"incorrect"}


def test_killed_driver_then_resume_gives_exactly_the_plan(tmp_path, cluster):
    out = tmp_path / "killed"
    on_cluster = ["--executor", "ray", "--ray-address", cluster.address]
    proc = bench_process("run", *on_cluster, *SLOW_RUN, "--out", str(out))
    wait_for_rows(out, 2, proc, limit=180)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver killed mid-run
    proc.wait()
    assert 2 <= len(read_rows(out)) < 8
    resumed = bench_process("run", "--resume", str(out), "--import", "fault_variants", *on_cluster)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    rows = run_dir_rows(out)
    assert sorted(zip(rows["variant"], rows["n"])) == sorted(
        (v, n) for v in ("test_slow", "full") for n in range(65, 69)
    )
    assert set(rows["status"]) == {"ok"}


def test_interrupt_cancels_outstanding_cells_and_keeps_finished_rows(tmp_path, cluster):
    # Ctrl-C reaches the sweep as KeyboardInterrupt (here raised when the first row is written, while the
    # other series' cell runs on the other node): outstanding tasks are cancelled, no row is written for
    # them, and every finished row stays. (The CLI's exit 130 and printed command are the local executor's
    # path, tested in test_harness.py; the command for a Ray run is checked below.)
    from harness.sweep import runner
    from harness.sweep.session import make_executor
    from harness.sweep.session import resume_hint

    config = cluster_config("test_slow,full", repeats=2, warmup=0)
    executor = make_executor("ray")
    names = {"cpu": sorted(executor.devices("cpu"))}
    out = tmp_path / "interrupted"
    out.mkdir()

    def interrupt(cell, row):
        if row is not None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.sweep(config, out, on_row=interrupt, device_names=names, executor=executor)
    kept = read_rows(out)
    assert 1 <= len(kept) < 8
    assert not [row for row in kept if row["status"] != "ok"]  # a cancelled cell leaves no row
    assert not executor._outstanding
    assert resume_hint(out, ("fault_variants",), True, "auto", ["GPU=1"]) == (
        f"bench run --resume {out} --import fault_variants --executor ray --ray-address auto --ray-resources GPU=1"
    )


def test_bad_executor_arguments_are_clear(tmp_path):
    result = bench("run", "--executor", "dask", "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "'dask' is not one of 'local', 'ray'" in " ".join(result.output.split())
    result = bench("run", "--ray-address", "auto", "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "--ray-address and --ray-resources go with --executor ray" in " ".join(
        result.output.split()
    )
    result = bench("run", "--executor", "ray", "--ray-resources", "GPU", "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "'GPU' is not NAME=AMOUNT" in " ".join(result.output.split())
    assert not (tmp_path / "x").exists()


def test_unreachable_address_fails_within_seconds_and_writes_nothing(tmp_path):
    started = time.monotonic()
    proc = bench_process("run", "--executor", "ray", "--ray-address", "127.0.0.1:9", "--out", str(tmp_path / "x"))
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output
    assert "nothing answers at 127.0.0.1:9" in " ".join(output.split())
    assert time.monotonic() - started < 20  # the process's own start included
    assert not (tmp_path / "x").exists()


def test_ray_not_installed_names_the_extra(monkeypatch):
    import sys

    from harness.sweep.ray_node import ray_module

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(
        RuntimeError, match=r"--executor ray needs the ray package, which is not installed: pip install -e '\.\[ray\]'"
    ):
        ray_module()


def test_two_gpu_kinds_are_two_devices_in_reports(tmp_path):
    # rows of one cuda kind on two GPU models (as a cluster of A100 and H100 nodes writes them): every table
    # and figure treats them as two devices
    from harness.readers.speed.frames import by_hardware

    import pandas as pd

    df = pd.DataFrame({"device": ["cuda", "cuda", "cpu"], "device_name": ["NVIDIA A100", "NVIDIA H100", "EPYC"]})
    assert list(by_hardware(df)["device"]) == ["cuda (NVIDIA A100)", "cuda (NVIDIA H100)", "cpu"]
    single = pd.DataFrame({"device": ["cuda", "cuda"], "device_name": ["NVIDIA H100", "NVIDIA H100"]})
    assert list(by_hardware(single)["device"]) == ["cuda", "cuda"]


@pytest.mark.slow
def test_a_node_lost_mid_cell_costs_one_retry_on_another_node(tmp_path, cluster):
    # opt in (-m slow): a third node joins, a sweep starts, the node is removed while a cell runs there
    import threading

    from harness.sweep import runner
    from harness.sweep.session import make_executor

    extra = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    config = cluster_config("test_slow,full,linear", repeats=3, warmup=1)
    executor = make_executor("ray")
    victim = extra.node_id
    assert executor.devices("cpu") and sum(executor.devices("cpu").values()) == 3
    out = tmp_path / "lost"
    out.mkdir()
    done = {}
    sweep = threading.Thread(
        target=lambda: done.setdefault(
            "rows", runner.sweep(config, out, device_names={"cpu": sorted(executor.devices("cpu"))}, executor=executor)
        )
    )
    sweep.start()
    deadline = time.time() + 120
    while time.time() < deadline and not any(job.node == victim for job in list(executor._outstanding)):
        time.sleep(0.02)
    assert any(job.node == victim for job in list(executor._outstanding)), "no cell ran on the third node"
    cluster.remove_node(extra)
    sweep.join(300)
    assert not sweep.is_alive()
    rows = read_rows(out)
    assert sorted((r["variant"], r["n"]) for r in rows) == sorted(
        (v, n) for v in ("test_slow", "full", "linear") for n in range(65, 69)
    )
    assert {r["status"] for r in rows} == {"ok"}, [r["message"] for r in rows if r["status"] != "ok"]
    assert executor._lost == {victim}
    assert executor.devices("cpu") == {rows[0]["device_name"]: 2}
