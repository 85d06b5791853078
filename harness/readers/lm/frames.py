"""A `bench lm` run read back as tables (pandas): perplexity, passkey, cost, distillation, decoding and
linearization, one row an attention setting."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.stats import bootstrap_paired_difference, bootstrap_pooled_mean, wilson_interval
from harness.store.storage import LM_RESULTS as RESULTS
from harness.store.storage import read_rows

OWN = "sdpa"


PANELS_ACROSS = 6  # passkey heatmaps a row


LEGEND_INSIDE = 8  # attentions a legend holds inside its axes; more go beside them


DISTILLED = " + distill "  # in a distilled attention's label (harness/lm/config.py's Setting.label)


LINEARIZED, LORA = (
    " + linearized",
    " + LoRA",
)  # a linearized attention's label; the model's own after LoRA alone (its control)


TWINS = (DISTILLED, LINEARIZED, LORA)


def base_of(setting: str) -> str:
    """The zero-shot attention a trained twin (distilled, linearized, the sdpa control) comes from."""
    for mark in TWINS:
        if mark in setting:
            return setting.split(mark)[0]
    return setting


def lm_frame(run_dir: Path) -> pd.DataFrame:
    rows = read_rows(Path(run_dir), RESULTS, quiet=True) if (Path(run_dir) / RESULTS).exists() else []
    return pd.DataFrame(rows)


def setting_order(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df["setting"]))


def perplexity_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length): the perplexity of every scored token of the windows together (exp of their mean NLL),
    its 95% bootstrap interval over the windows (`ppl_low`, `ppl_high`), min and max of the windows, windows, tokens."""
    columns = ["setting", "length", "ppl", "ppl_low", "ppl_high", "ppl_min", "ppl_max", "windows", "tokens"]
    ppl = df[df["task"] == "perplexity"] if "task" in df else df.iloc[:0]
    if ppl.empty:
        return pd.DataFrame(columns=columns)
    out = []
    for (setting, length), group in ppl.groupby(["setting", "length"], sort=False):
        sums, counts = list(group["nll"] * group["scored"]), [int(c) for c in group["scored"]]
        low, high = bootstrap_pooled_mean(sums, counts)
        nll = sum(sums) / sum(counts)
        out.append([setting, length, math.exp(nll), math.exp(low), math.exp(high), group["ppl"].min()])
        out[-1] += [group["ppl"].max(), group["window"].nunique(), sum(counts)]
    return pd.DataFrame(out, columns=columns)


def paired_ratio_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length) scored on the same windows as the model's own sdpa: perplexity / sdpa's on those windows
    and its 95% paired bootstrap interval (the windows resampled together: the texts' own spread cancels)."""
    columns = ["setting", "length", "ratio", "low", "high", "windows"]
    ppl = df[df["task"] == "perplexity"] if "task" in df else df.iloc[:0]
    own = {(int(r.length), int(r.window)): r for r in ppl[ppl["setting"] == OWN].itertuples()}
    out = []
    for (setting, length), group in ppl[ppl["setting"] != OWN].groupby(["setting", "length"], sort=False):
        pairs = [
            (r, own[(int(length), int(r.window))]) for r in group.itertuples() if (int(length), int(r.window)) in own
        ]
        if not pairs or any(a.scored != b.scored or a.start != b.start for a, b in pairs):
            continue  # (windows that are not the same text: no paired comparison)
        sums_a, sums_b = [a.nll * a.scored for a, _ in pairs], [b.nll * b.scored for _, b in pairs]
        counts = [int(a.scored) for a, _ in pairs]
        low, high = bootstrap_paired_difference(sums_a, sums_b, counts)
        ratio = math.exp((sum(sums_a) - sum(sums_b)) / sum(counts))
        out.append([setting, length, ratio, math.exp(low), math.exp(high), len(pairs)])
    return pd.DataFrame(out, columns=columns)


def position_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length, position bucket [lo, hi)) of the windows that recorded one: the mean NLL of every token
    at those positions over the windows (runs made before scored no bucket: empty)."""
    rows = df[df["task"] == "perplexity"] if "task" in df and "position_nll" in df else df.iloc[:0]
    totals: dict[tuple, list[float]] = {}
    for r in rows.itertuples():
        if not isinstance(r.position_nll, list):
            continue
        for lo, hi, total, count in r.position_nll:
            cell = totals.setdefault((r.setting, int(r.length), int(lo), int(hi)), [0.0, 0])
            cell[0], cell[1] = cell[0] + total, cell[1] + count
    out = [[*key, total / count, count] for key, (total, count) in totals.items() if count]
    return pd.DataFrame(out, columns=["setting", "length", "lo", "hi", "nll", "tokens"])


def passkey_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length, depth): exact-match accuracy over the keys and its Wilson 95% interval."""
    keys = df[df["task"] == "passkey"] if "task" in df else df.iloc[:0]
    return _accuracy(keys, ["setting", "length", "depth"], "keys")


def ruler_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length, RULER subtask): exact-match accuracy over the trials and its Wilson 95% interval."""
    rows = df[df["task"].astype(str).str.startswith("ruler:")] if "task" in df else pd.DataFrame()
    if not rows.empty:
        rows = rows.assign(subtask=rows["task"].str.split(":").str[1])
    return _accuracy(rows, ["setting", "length", "subtask"], "trials")


def _accuracy(rows: pd.DataFrame, by: list[str], count: str) -> pd.DataFrame:
    """Per group of `by`: the mean of `correct`, the trials (column `count`), Wilson's 95% interval (low, high)."""
    if rows.empty:
        return pd.DataFrame(columns=[*by, "accuracy", count, "low", "high"])
    rows = rows.assign(correct=rows["correct"].astype(float))
    out = (
        rows.groupby(by, sort=False)
        .agg(accuracy=("correct", "mean"), **{count: ("correct", "size")}, right=("correct", "sum"))
        .reset_index()
    )
    bounds = [wilson_interval(int(r), int(n)) for r, n in zip(out["right"], out[count])]
    out["low"], out["high"] = [b[0] for b in bounds], [b[1] for b in bounds]
    return out.drop(columns=["right"])


def cost_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length): a forward's time and peak extra memory, its ratio to the model's own sdpa at that
    length, and from the passkey rows a generated token's median time and the decoding state's bytes."""
    cost = df[df["task"] == "cost"]
    cost = (
        cost[["setting", "length", "forward_s", "peak_bytes"]]
        if not cost.empty
        else pd.DataFrame(columns=["setting", "length"])
    )
    keys = df[df["task"] == "passkey"]
    if not keys.empty:
        gen = (
            keys.groupby(["setting", "length"], sort=False)
            .agg(token_s=("token_s", "median"), state_bytes=("state_bytes", "max"))
            .reset_index()
        )
        cost = gen if cost.empty else cost.merge(gen, on=["setting", "length"], how="outer")
    if cost.empty:
        return cost
    if "forward_s" in cost:
        base = cost[cost["setting"] == OWN].set_index("length")["forward_s"]
        cost["vs_sdpa"] = [
            t / base[n] if n in base.index and base[n] else None for n, t in zip(cost["length"], cost["forward_s"])
        ]
    return cost


def distill_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per distilled attention: its parameters, steps, time, and the held-out attention-output error (mean over
    layers, a fraction of the softmax output's mean square) before and after attention transfer."""
    rows = df[df["task"] == "distill"] if "task" in df else df
    columns = ["setting", "parameters", "steps", "lr", "tokens", "distill_s", "error_before", "error_after"]
    return rows[columns].reset_index(drop=True) if not rows.empty else pd.DataFrame(columns=columns)


def decode_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, length) of the decode rows: the median generated token's time, its ratio to the model's own
    sdpa with its KV cache at that length, the state's bytes after the prompt and their ratio to sdpa's cache."""
    rows = df[df["task"] == "decode"] if "task" in df else df.iloc[:0]
    if rows.empty:
        return pd.DataFrame(columns=["setting", "length", "token_s", "vs_sdpa", "state_bytes", "state_vs_sdpa"])
    out = rows[["setting", "length", "token_s", "token_min_s", "prefill_s", "state_bytes"]].copy()
    own = out[out["setting"] == OWN].set_index("length")
    out["vs_sdpa"] = [t / own["token_s"][n] if n in own.index else None for n, t in zip(out["length"], out["token_s"])]
    out["state_vs_sdpa"] = [
        b / own["state_bytes"][n] if n in own.index else None for n, b in zip(out["length"], out["state_bytes"])
    ]
    return out.reset_index(drop=True)


def decode_exponent(table: pd.DataFrame, setting: str, low: int = 1024) -> float | None:
    """The fitted exponent of a generated token's time against the context, from `low` to the longest length
    (least squares on the logs): 0 for a constant cost, 1 for one linear in the context."""
    mine = table[(table["setting"] == setting) & (table["length"] >= low)]
    if len(mine) < 2:
        return None
    x, y = [math.log(n) for n in mine["length"]], [math.log(t) for t in mine["token_s"]]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def linearize_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per linearized attention: each stage's trained parameters, steps, tokens and seconds, stage 1's held-out
    attention error (and, in runs that read it, after by position: a dict) and stage 2's held-out next-token loss
    before and after, the seconds in all."""
    rows = df[df["task"] == "linearize"] if "task" in df else df
    out = []
    for r in rows.itertuples():
        t, lo = (x if isinstance(x, dict) else {} for x in (getattr(r, "transfer", None), getattr(r, "lora", None)))
        out.append(
            {
                "setting": r.setting,
                "seconds": r.seconds,
                "tokens": r.tokens,
                **{
                    f"transfer_{k}": t.get(k)
                    for k in (
                        "parameters",
                        "steps",
                        "seconds",
                        "error_before",
                        "error_after",
                        "error_by_position",
                        "older_share",
                    )
                },
                **{
                    f"lora_{k}": lo.get(k)
                    for k in ("parameters", "steps", "seconds", "nll_before", "nll_after", "rank")
                },
            }
        )
    return pd.DataFrame(out)
