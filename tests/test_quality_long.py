"""Long-range quality: distances in the tasks, accuracy by distance, seeds, the curriculum, resume,
the training cost, and `bench advise` / the trade-off report on synthetic runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.policy import recorded_facts
from harness.quality.config import TrainConfig
from harness.quality.tasks import CopyTask, RecallTask, distance_buckets
from harness.quality.train import train_one
from harness.readers.quality.frames import by_distance_frame
from harness.store.storage import QUALITY_RESULTS, RowWriter, read_rows, variant_facts, write_metadata
from helpers import bench, make_run

TINY = TrainConfig(d_model=16, heads=2, layers=1, steps=6, batch=4, eval_every=3, eval_examples=16)


_invoke = bench


def _text(result) -> str:
    return " ".join(result.output.replace("│", " ").split())


# --- the tasks' distances --------------------------------------------------------------------


def test_copy_distance_is_the_string_length():
    s = CopyTask(length=5, vocab=7).sample(3, torch.Generator().manual_seed(0))
    assert (s.distance[s.mask] == 5).all() and (s.distance[~s.mask] == -1).all()
    # the answer really sits `distance` positions back in the inputs
    b, t = s.mask.nonzero(as_tuple=True)
    assert torch.equal(s.inputs[b, t - 5], s.targets[b, t])


def test_recall_distance_on_a_hand_checked_example(monkeypatch):
    # 3 pairs (keys 0,1,2 -> values 5,6,7), then the queries 1, 1, 0 (the dense layout): hand-counted distances
    task = RecallTask(length=12, vocab=10, pairs=3)
    values, asked = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 0]])
    draws = iter([torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4]]), values, asked])  # the first draw orders the keys 0, 1, 2
    monkeypatch.setattr(torch, "rand", lambda *a, **k: next(draws))
    monkeypatch.setattr(torch, "randint", lambda *a, **k: next(draws))
    s = task.sample(1, torch.Generator())
    # sequence: 0 5 1 6 2 7 | 1 6 1 6 0 5 ; inputs drop the last token
    assert s.inputs[0].tolist() == [0, 5, 1, 6, 2, 7, 1, 6, 1, 6, 0]
    assert s.mask[0].nonzero().flatten().tolist() == [6, 8, 10]
    # query 1 at 6: value 6 at position 3 -> 3; query 1 at 8: the earlier answer at 7 -> 1; query 0 at 10: value 5 at 1 -> 9
    assert s.distance[0][s.mask[0]].tolist() == [3, 1, 9]


def _brute_distance(inputs, targets, mask):
    """For each scored position: back to the nearest earlier place where its key is followed by its answer."""
    out = torch.full_like(targets, -1)
    for b, t in mask.nonzero().tolist():
        for s in range(t - 1, -1, -1):
            if inputs[b, s] == inputs[b, t] and inputs[b, s + 1] == targets[b, t]:
                out[b, t] = t - (s + 1)
                break
    return out


@pytest.mark.parametrize(
    "layout", [dict(length=64), dict(length=96, pairs=8, queries=8), dict(length=40, pairs=4, queries=2)]
)
def test_recall_distances_match_a_brute_force_search(layout):
    s = RecallTask(**layout).sample(8, torch.Generator().manual_seed(1))
    assert torch.equal(s.distance, _brute_distance(s.inputs, s.targets, s.mask))


def test_recall_asked_once_among_filler():
    task = RecallTask(length=256, pairs=8, queries=8)
    s = task.sample(16, torch.Generator().manual_seed(2))
    assert (s.mask.sum(1) == 8).all()
    filler = task.symbols
    assert (s.inputs[:, 16:] == filler).sum(1).min() > 200  # the rest is filler
    asked = s.inputs[s.mask].reshape(16, 8)
    assert all(len(set(row)) == 8 for row in asked.tolist())  # each key once
    assert s.distance[s.mask].max() > 128  # long distances exist


@pytest.mark.parametrize("length", [16, 256, 4096])
def test_recall_keys_stay_distinct_at_every_length(length):
    task = RecallTask(length=length)  # default pairs L/8: the vocabulary grows with them
    assert task.symbols >= 2 * task.num_pairs
    s = task.sample(4, torch.Generator().manual_seed(0))
    bindings = s.inputs[:, : 2 * task.num_pairs : 2]
    assert all(len(set(row)) == task.num_pairs for row in bindings.tolist())


def test_by_distance_counts_sum_to_the_scored_positions():
    s = RecallTask(length=128, pairs=8, queries=8).sample(32, torch.Generator().manual_seed(3))
    correct = torch.rand(s.targets.shape, generator=torch.Generator().manual_seed(4)) < 0.5
    buckets = distance_buckets(s.distance, correct, s.mask)
    assert sum(b["count"] for b in buckets) == int(s.mask.sum())
    for b in buckets:
        assert b["max"] == 2 * b["min"] - 1 and math.log2(b["min"]).is_integer()
        sel = s.mask & (s.distance >= b["min"]) & (s.distance <= b["max"])
        assert b["count"] == int(sel.sum()) and b["accuracy"] == pytest.approx(correct[sel].float().mean().item())


# --- training: seeds, curriculum, rows -----------------------------------------------------------


def test_a_seed_reproduces_bit_identical_rows_and_another_differs():
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]  # noqa: E731
    a = train_one("recall", 16, "full", {}, TINY, seed=1)
    b = train_one("recall", 16, "full", {}, TINY, seed=1)
    c = train_one("recall", 16, "full", {}, TINY, seed=2)
    assert strip(a) == strip(b) and strip(a) != strip(c)
    assert all(r["seed"] == 1 and r["by_distance"] for r in a)


def test_the_curriculum_trains_one_model_through_the_lengths():
    cfg = TrainConfig(**{**TINY.__dict__, "curriculum": True, "pairs": 2, "queries": 2, "warm_start": 2})
    rows = train_one("recall", (16, 32), "sliding_window", {"window": 4}, cfg, seed=0)
    assert [(r["length"], r["stage"], r["step"], r["final"]) for r in rows] == [
        (16, 0, 3, False),
        (16, 0, 6, True),
        (32, 1, 3, False),
        (32, 1, 6, True),
    ]
    assert rows[-1]["cfg_curriculum"] and rows[-1]["cfg_warm_start"] == 2


def test_batch_tokens_caps_a_long_stages_batch_and_the_row_and_report_say_so(tmp_path):
    assert [TrainConfig(batch=32, batch_tokens=8192).batch_at(n) for n in (63, 255, 511, 1023, 10**5)] == [
        32,
        32,
        16,
        8,
        1,
    ]
    assert TrainConfig(batch=32).batch_at(10**5) == 32
    out = tmp_path / "q"
    args = [
        "quality",
        "--task",
        "recall",
        "--variants",
        "full",
        "--lengths",
        "16,32",
        "--curriculum",
        "--batch",
        "4",
        "--batch-tokens",
        "64",
        "--pairs",
        "2",
        "--queries",
        "2",
        "--steps",
        "2",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--no-cost",
        "--out",
        str(out),
    ]
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    rows = read_rows(out, QUALITY_RESULTS)
    assert {(r["length"], r["batch"], r["cfg_batch"], r["cfg_batch_tokens"]) for r in rows} == {
        (16, 4, 4, 64),
        (32, 2, 4, 64),
    }
    assert "batch=4 (at most 64 tokens a batch: 2 at 31 tokens)" in (out / "REPORT.md").read_text()


def test_long_lengths_are_trained_by_the_long_variants_only_after_the_others(tmp_path):
    out = tmp_path / "q"
    base = [
        "quality",
        "--task",
        "recall",
        "--variants",
        "full,linear",
        "--lengths",
        "16",
        "--curriculum",
        "--pairs",
        "2",
        "--queries",
        "2",
        "--steps",
        "2",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--batch",
        "4",
        "--no-cost",
    ]
    result = _invoke(*base, "--long-lengths", "24", "--long-variants", "full", "--out", str(out))
    assert result.exit_code == 0, result.output
    rows = read_rows(out, QUALITY_RESULTS)
    assert sorted({(r["variant"], r["length"], r["stage"]) for r in rows}) == [
        ("full", 16, 0),
        ("full", 24, 1),
        ("linear", 16, 0),
    ]
    assert "L = 24 trained by `full` only" in (out / "REPORT.md").read_text()
    again = _invoke("quality", "--resume", str(out), "--no-report")  # the stored configuration keeps them
    assert again.exit_code == 0 and len(read_rows(out, QUALITY_RESULTS)) == len(rows)
    for extra, message in (
        (["--long-lengths", "16"], "each must be longer than the longest of --lengths (16)"),
        (["--long-lengths", "24", "--long-variants", "gla"], "gla not among the run's variants"),
        (["--long-variants", "full"], "but no long lengths are set"),
    ):
        bad = _invoke(*base, *extra, "--out", str(tmp_path / "bad"))
        assert bad.exit_code == 2 and message in " ".join(bad.output.replace("│", "").split()), bad.output
        assert not (tmp_path / "bad").exists()


def test_a_seed_trains_variant_by_variant_one_of_each_family_first():
    # an interrupted long run then holds whole families (every task of the representatives) before the rest
    from harness.quality.config import QualityConfig
    from harness.quality.trainings import trainings

    config = QualityConfig(
        tasks=("copy", "recall"),
        variants=("additive", "full", "linear"),
        lengths=(16,),
        seeds=2,
        train=TrainConfig(curriculum=True),
        long_lengths=(32,),
        long_variants=("linear", "full"),
    )
    assert [(s, v, t) for t, v, s, _ in trainings(config)][:6] == [
        (0, "linear", "copy"),
        (0, "linear", "recall"),
        (0, "full", "copy"),
        (0, "full", "recall"),
        (0, "additive", "copy"),
        (0, "additive", "recall"),
    ]
    assert len(trainings(config)) == 12 and dict(((v, t), chain) for t, v, s, chain in trainings(config))[
        ("full", "recall")
    ] == (16, 32)


def test_quality_with_seeds_resumes_exactly(tmp_path):
    out = tmp_path / "q"
    args = [
        "quality",
        "--task",
        "recall",
        "--variants",
        "full",
        "--lengths",
        "16,24",
        "--curriculum",
        "--seeds",
        "2",
        "--pairs",
        "2",
        "--queries",
        "2",
        "--steps",
        "4",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--batch",
        "4",
        "--no-cost",
        "--no-report",
        "--out",
        str(out),
    ]
    assert _invoke(*args).exit_code == 0
    whole = read_rows(out, QUALITY_RESULTS)
    assert sorted({(r["seed"], r["length"]) for r in whole}) == [(0, 16), (0, 24), (1, 16), (1, 24)]
    # interrupted in seed 1's second stage: seed 1 is redone whole, seed 0 kept
    lines = (out / QUALITY_RESULTS).read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if json.loads(line)["seed"] == 1 and json.loads(line)["length"] == 24)
    (out / QUALITY_RESULTS).write_text("\n".join(lines[:cut]) + "\n")
    assert _invoke("report", str(out)).exit_code == 0  # an unfinished run's report says which cells lack seeds
    report = (out / "REPORT.md").read_text()
    assert "(1 of 2 seeds)" in report and "The run is unfinished" in report
    result = _invoke("quality", "--resume", str(out), "--no-report")
    assert result.exit_code == 0, result.output
    again = read_rows(out, QUALITY_RESULTS)
    strip = lambda rows: sorted(json.dumps({k: v for k, v in r.items() if k != "wall_s"}, sort_keys=True) for r in rows)  # noqa: E731
    assert strip(again) == strip(whole)


def test_a_report_names_the_variants_a_stopped_run_has_not_trained(tmp_path):
    # the capacity layout: the queries fill every place after the bindings (no filler); a run stopped after its first variant
    out = tmp_path / "q"
    args = [
        "quality",
        "--task",
        "recall",
        "--variants",
        "full,linear",
        "--lengths",
        "16",
        "--pairs",
        "4",
        "--queries",
        "4",
        "--steps",
        "2",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--batch",
        "4",
        "--no-cost",
        "--no-report",
        "--out",
        str(out),
    ]
    assert _invoke(*args).exit_code == 0
    kept = [line for line in (out / QUALITY_RESULTS).read_text().splitlines() if json.loads(line)["variant"] == "full"]
    (out / QUALITY_RESULTS).write_text("\n".join(kept) + "\n")
    assert _invoke("report", str(out)).exit_code == 0
    report = (out / "REPORT.md").read_text()
    assert "4 distinct keys asked once each, no filler" in report
    assert (
        "The run is unfinished" in report
        and "variants not trained yet: `linear`." in report
        and "fewer seeds" not in report
    )


def test_quality_report_shows_seeds_distance_and_cost(tmp_path):
    out = tmp_path / "q"
    result = _invoke(
        "quality",
        "--preset",
        "long",
        "--variants",
        "full,sliding_window",
        "--lengths",
        "24,32",
        "--copy-lengths",
        "8",
        "--seeds",
        "2",
        "--steps",
        "3",
        "--warm-start",
        "2",
        "--pairs",
        "2",
        "--queries",
        "2",
        "--d-model",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--batch",
        "4",
        "--window",
        "4",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    costs = read_rows(out, "train_cost.jsonl")
    assert sorted((r["task"], r["variant"], r["length"]) for r in costs) == sorted(
        [("copy", v, 8) for v in ("full", "sliding_window")]
        + [("recall", v, n) for v in ("full", "sliding_window") for n in (24, 32)]
    )
    assert all(
        r["status"] == "ok" and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["train_peak_bytes"] >= 0 for r in costs
    )
    text = (out / "REPORT.md").read_text()
    assert "### Accuracy by distance" in text and "### Cost of a training step" in text and "seeds 0-1" in text
    for name in ("quality_accuracy", "quality_distance", "training_cost", "quality_curves"):
        assert (out / "figures" / f"{name}.png").exists(), name
    distance = by_distance_frame(read_rows(out, QUALITY_RESULTS), variant_facts(out))
    assert set(distance["window"].dropna()) == {4}


# --- advise and the trade-off report ---------------------------------------------------------------


def make_quality_run(path, accuracy: dict, lengths=(256,), device="cpu", lr=3e-3):
    """A quality run whose final rows give `accuracy[variant]` (3 seeds spread +-2 points) at each length."""
    path.mkdir(parents=True)
    write_metadata(
        path,
        {
            "config": {"tasks": ["recall"], "variants": list(accuracy), "lengths": list(lengths), "seeds": 3},
            "environment": {},
            "machine": {},
            "variants": recorded_facts(tuple(accuracy)),
        },
    )
    with RowWriter(path, QUALITY_RESULTS) as writer:
        for variant, acc in accuracy.items():
            for n in lengths:
                for seed, delta in enumerate((-0.02, 0.0, 0.02)):
                    a = min(1.0, max(0.0, acc + delta))
                    writer.append(
                        {
                            "task": "recall",
                            "variant": variant,
                            "length": n,
                            "seed": seed,
                            "final": True,
                            "step": 10,
                            "device": device,
                            "options": {"window": 64} if variant == "sliding_window_flex" else {},
                            "cfg_lr": lr,
                            "eval_accuracy": a,
                            "eval_exact_match": 0.0,
                            "wall_s": 1.0,
                            "by_distance": [
                                {"min": 1, "max": 127, "accuracy": a, "count": 10},
                                {"min": 128, "max": 255, "accuracy": a / 2, "count": 10},
                            ],
                        }
                    )
    return path


def test_advise_marks_measured_interpolated_and_extrapolated(tmp_path):
    from harness.readers.advise.answer import advise

    speed = make_run(tmp_path / "speed")
    quality = make_quality_run(tmp_path / "quality", {"full": 0.95, "linear": 0.4})
    measured, _ = advise([speed, quality], n=1024, causal=False)
    by = {a.variant: a for a in measured}
    assert by["full"].how == "measured" and by["full"].time_s == pytest.approx(1e-9 * 1024**2)
    assert by["full_naive"].how == "measured" and by["full_naive"].accuracy == pytest.approx(0.95)  # full's function
    between, _ = advise([speed, quality], n=1500, causal=False)
    assert next(a for a in between if a.variant == "full").how == "interpolated between N=1024 and N=2048"
    far, _ = advise([speed, quality], n=16384, causal=False)
    by = {a.variant: a for a in far}
    assert by["full"].how.startswith("extrapolated from N=4096 (~N^2.00)") and by["full"].time_s == pytest.approx(
        1e-9 * 16384**2
    )
    assert by["linear"].time_s == pytest.approx(2e-6 * 16384)
    assert by["full_naive"].excluded == "oom at N=2048" and by["full_naive"].rank is None
    assert "trained at L=256 < N" in "; ".join(by["full"].quality_note)
    assert by["full"].accuracy_range == pytest.approx((0.93, 0.97))


def test_advise_filters_by_memory_and_accuracy(tmp_path):
    from harness.readers.advise.answer import advise
    from harness.readers.advise.text import recommendation

    speed = make_run(tmp_path / "speed")
    quality = make_quality_run(tmp_path / "quality", {"full": 0.95, "linear": 0.4})
    answers, ctx = advise([speed, quality], n=4096, causal=False, memory=64 * 4096 + 1, min_accuracy=0.9)
    by = {a.variant: a for a in answers}
    assert by["full"].rank == 1 and by["linear"].excluded.startswith("needs")
    assert "Use full: the fastest that fits in" in recommendation(answers, ctx)
    answers, ctx = advise([speed, quality], n=4096, causal=False, min_accuracy=0.3)
    assert next(a for a in answers if a.rank == 1).variant == "linear"  # faster at 4096, keeps >= 30%
    answers, ctx = advise([speed, quality], n=4096, causal=False, min_accuracy=0.999)
    assert all(a.rank is None for a in answers)
    assert recommendation(answers, ctx).startswith("No variant keeps >= 99.9% on recall at N=4096: see the reasons")
    answers, ctx = advise([speed, quality], n=4096, causal=False, memory=1, min_accuracy=0.5)
    assert recommendation(answers, ctx).startswith("No variant fits in 1 B and keeps >= 50% on recall at N=4096")


def test_advise_cli_and_its_bad_input(tmp_path):
    speed = make_run(tmp_path / "speed")
    quality = make_quality_run(tmp_path / "quality", {"full": 0.95, "linear": 0.4})
    result = _invoke("advise", "--len", "8192", "--no-causal", "--min-accuracy", "90%", str(speed), str(quality))
    assert result.exit_code == 0, result.output
    text = _text(result)
    assert "extrapolated from N=4096" in text and "Use full" in text and "accuracy 40.0% < 90%" in text
    bad = [
        (["--len", "1024", str(quality)], "needs at least one speed run"),
        (["--len", "1024", "--device", "cuda", str(speed)], "--device cuda: the speed runs hold cpu only"),
        (["--len", "1024", str(speed)], "no fwdbwd causal rows on cpu"),
        (
            ["--len", "1024", "--no-causal", "--task", "copy", str(speed), str(quality)],
            "--task copy: the quality runs trained recall only",
        ),
        (["--len", "1024", "--no-causal", "--min-accuracy", "150%", str(speed)], "--min-accuracy"),
        (["--len", "0", str(speed)], "0 is not allowed"),
        (["--len", "1" + "0" * 300, str(speed)], "is not allowed; use 1 <= value <= 2147483648"),
        (["--len", "1024", "--no-causal", "--memory", "0", str(speed)], "--memory: '0' is no memory at all"),
        (["--len", "1024", "--no-causal", "--memory", "lots", str(speed)], "--memory"),
        (["--len", "1024", str(tmp_path / "nowhere")], "nowhere"),
        (
            [
                "--len",
                "1024",
                "--no-causal",
                str(speed),
                str(make_quality_run(tmp_path / "gpu", {"full": 0.9}, device="cuda")),
            ],
            "the runs share no device: the quality runs trained on cuda, the speed rows used are cpu",
        ),
        # two recipes of one training are not seeds of one: never pooled
        (
            [
                "--len",
                "1024",
                "--no-causal",
                str(speed),
                str(quality),
                str(make_quality_run(tmp_path / "lr", {"full": 0.5}, lr=1e-2)),
            ],
            f"recall of full at L=256 was trained with different recipes: lr 0.003 in {quality} but 0.01 in {tmp_path / 'lr'}",
        ),
    ]
    for args, message in bad:
        result = _invoke("advise", *args)
        assert result.exit_code == 2 and message in _text(result), (args, result.output)


def test_advise_ranks_by_a_default_floor_and_reads_at_80_columns(tmp_path):
    """Without --min-accuracy a variant must keep within 10 points of full's accuracy to be ranked (linear's
    40% against full's 95% is not ranked first for being fast); the table fits 80 columns with whole names,
    its notes numbered under it; markdown and json carry the same answer."""
    from harness.readers.advise.answer import advise

    speed = make_run(tmp_path / "speed")
    quality = make_quality_run(tmp_path / "quality", {"full": 0.95, "linear": 0.4})
    answers, ctx = advise([speed, quality], n=4096, causal=False)
    by = {a.variant: a for a in answers}
    assert ctx["min_accuracy"] == pytest.approx(0.85) and "within 10 points of full" in ctx["floor"]
    assert by["linear"].rank is None and by["linear"].excluded == "accuracy 40.0% < 85%" and by["full"].rank == 1
    answers, _ = advise([speed, quality], n=4096, causal=False, min_accuracy=0)
    assert next(a for a in answers if a.rank == 1).variant == "linear"  # no floor: the fastest
    answers, ctx = advise([speed], n=4096, causal=False)  # no quality run: no floor to speak of
    assert ctx["min_accuracy"] is None and ctx["floor"] == ""
    result = _invoke("advise", "--len", "8192", "--no-causal", str(speed), str(quality), columns=80)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80, result.output
    rows = {
        line.split()[1]: line
        for line in lines
        if line.split()[:1] in (["1"], ["2"], ["3"], ["-"]) and len(line.split()) > 2
    }
    assert {"full", "full_naive", "linear"} <= set(rows), result.output  # names whole, one row each
    assert rows["full"].split()[0] == "1" and rows["linear"].split()[0] == "-"
    assert (
        any(line.strip().startswith("[1] ") for line in lines)
        and "ranked if within 10 points of full's accuracy" in result.output
    )
    assert "every variant with an accuracy: trained at L=256 < N" in result.output  # said once, not in each note
    assert "L=256" not in rows["full"]  # the trained length is the title's, when every accuracy shares it
    markdown = _invoke("advise", "--len", "8192", "--no-causal", "--format", "markdown", str(speed), str(quality))
    assert markdown.exit_code == 0 and markdown.output.startswith("| rank | variant |"), markdown.output
    data = json.loads(
        _invoke("advise", "--len", "8192", "--no-causal", "--format", "json", str(speed), str(quality)).output
    )
    assert data["context"]["min_accuracy"] == pytest.approx(0.85) and data["answers"][0]["variant"] == "full"
    assert data["recommendation"].startswith("Use full: the fastest that keeps >= 85% on recall")


def _edited_copy(run, path, **changes):
    """A copy of a speed run with every row's fields changed (`time_factor` scales the times)."""
    import shutil

    from harness.store.storage import RESULTS

    shutil.copytree(run, path)
    factor = changes.pop("time_factor", 1.0)
    meta = json.loads((path / "metadata.json").read_text())
    meta["config"].update({k: v for k, v in changes.items() if k in ("batch", "heads", "head_dim", "dtype")})
    (path / "metadata.json").write_text(json.dumps(meta))
    lines = []
    for line in (path / RESULTS).read_text().splitlines():
        row = {**json.loads(line), **changes}
        if row.get("time_median_s"):
            row["time_median_s"] *= factor
        lines.append(json.dumps(row))
    (path / RESULTS).write_text("\n".join(lines) + "\n")
    return path


def test_advise_never_pools_speed_rows_of_different_setups(tmp_path):
    # finding 5: runs of other shapes or machines were merged, taking the minimum time at each N
    from harness.readers.advise.answer import advise

    speed = _edited_copy(make_run(tmp_path / "made"), tmp_path / "speed", device_name="Test CPU")
    heads = _edited_copy(speed, tmp_path / "heads", heads=2)
    machine = _edited_copy(speed, tmp_path / "machine", device_name="Other CPU", time_factor=0.1)
    for other in (heads, machine):
        result = _invoke("advise", "--len", "1024", "--no-causal", str(speed), str(other))
        assert result.exit_code == 2 and "the speed runs measured different setups" in _text(result), result.output
    from harness.options import ArgumentError

    with pytest.raises(
        ArgumentError, match=rf"heads 8 in {speed}, 2 in {heads} \(give speed runs of one machine and shape\)"
    ):
        advise([speed, heads], n=1024, causal=False)
    with pytest.raises(ArgumentError, match=rf"device_name Test CPU in {speed}, Other CPU in {machine}"):
        advise([speed, machine], n=1024, causal=False)
    # two runs of one setup measuring one cell: their median, said so (not the faster of the two)
    again = _edited_copy(speed, tmp_path / "again", time_factor=3.0)
    answers, _ = advise([speed, again], n=1024, causal=False)
    full = next(a for a in answers if a.variant == "full")
    assert full.time_s == pytest.approx(2e-9 * 1024**2) and full.how == "measured (median of 2 runs)"
    # one variant timed with other options in another run: two answers, labelled, never one
    window = _edited_copy(speed, tmp_path / "window", options={"window": 64})
    answers, _ = advise([speed, window], n=1024, causal=False)
    labels = sorted(a.label for a in answers if a.variant == "linear")
    assert labels == ["linear", "linear (window=64)"]


def test_advise_at_a_trained_length_below_the_timed_ones_extrapolates_and_says_so(tmp_path):
    # finding 12: with the speed runs timed from N = 256 and recall trained at L = 32, 64, --len 64 was refused
    from harness.readers.advise.answer import advise

    speed = make_run(tmp_path / "speed")
    short = make_quality_run(tmp_path / "short", {"full": 0.9}, lengths=(32, 64))
    answers, _ = advise([speed, short], n=64, causal=False)
    full = next(a for a in answers if a.variant == "full")
    assert (
        full.how.startswith("extrapolated down from N=256")
        and full.quality_length == 64
        and full.accuracy == pytest.approx(0.9)
    )


def test_advise_says_a_task_has_no_finished_training(tmp_path):
    from harness.readers.advise.answer import advise
    from harness.options import ArgumentError

    speed = make_run(tmp_path / "speed")
    quality = make_quality_run(tmp_path / "quality", {"full": 0.95})
    lines = [json.loads(line) for line in (quality / QUALITY_RESULTS).read_text().splitlines()]
    copy = [{**row, "task": "copy"} for row in lines]  # copy finished; recall only begun
    begun = [{**row, "final": False} for row in lines]
    (quality / QUALITY_RESULTS).write_text("\n".join(json.dumps(r) for r in copy + begun) + "\n")
    with pytest.raises(
        ArgumentError,
        match=r"--task recall: the quality runs hold no finished recall training yet \(only 3 "
        r"evaluation rows of unfinished ones\); finished: copy",
    ):
        advise([speed, quality], n=256, causal=False, task="recall")


def test_advise_states_unequal_seeds(tmp_path):
    # finding 6: an unfinished quality run averaged full over 3 seeds and the others over 2, without a word
    from harness.readers.advise.answer import advise
    from harness.readers.advise.text import advise_table

    speed = make_run(tmp_path / "speed")
    quality = make_quality_run(tmp_path / "quality", {"full": 0.95, "linear": 0.4})
    lines = (quality / QUALITY_RESULTS).read_text().splitlines()
    kept = [line for line in lines if not (json.loads(line)["variant"] == "linear" and json.loads(line)["seed"] == 2)]
    (quality / QUALITY_RESULTS).write_text("\n".join(kept) + "\n")
    answers, _ = advise([speed, quality], n=256, causal=False)
    by = {a.variant: a for a in answers}
    assert "2 of 3 seeds" in "; ".join(by["linear"].quality_note)
    assert not any("seeds" in note for note in by["full"].quality_note)
    assert "2 of 3 seeds" in advise_table(answers).set_index("variant").loc["linear", "notes"]


def test_tradeoff_report_draws_accuracy_against_time(tmp_path):
    speed = make_run(tmp_path / "speed")
    quality = make_quality_run(tmp_path / "quality", {"full": 0.95, "linear": 0.4})
    out = tmp_path / "tradeoff"
    # the made-up speed run is non-causal and has no causal rows: the report says so
    result = _invoke("report", str(speed), str(quality), "--out", str(out))
    assert result.exit_code == 2 and "no fwdbwd causal rows" in _text(result)
    from harness.readers.advise.tradeoff import write_tradeoff_report

    path, figures = write_tradeoff_report([speed, quality], out, causal=False)
    text = path.read_text()
    assert "### recall, N=256" in text and "Use full" in text and figures[0].exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quality_trains_on_cuda_in_bfloat16():
    rows = train_one("recall", 16, "full", {}, TINY, seed=0, device="cuda", dtype="bfloat16")
    assert rows[-1]["device"] == "cuda" and rows[-1]["dtype"] == "bfloat16" and 0 <= rows[-1]["eval_accuracy"] <= 1


@pytest.mark.parametrize(
    "variant, options",
    [("full", {}), ("sliding_window", {"window": 4}), ("linear", {}), ("memory_compressed", {"compression": 3})],
)
def test_every_variant_trains_under_bfloat16_autocast(variant, options):
    # the CUDA bf16 recipe's dtype mixing (autocast matmuls, float32 parameters), checked with CPU autocast
    rows = train_one("recall", 16, variant, options, TINY, seed=0, device="cpu", dtype="bfloat16")
    assert rows[-1]["dtype"] == "bfloat16" and math.isfinite(rows[-1]["train_loss"])
