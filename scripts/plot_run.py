#!/usr/bin/env python3
"""A PNG dashboard of one or more training runs, from their metrics.jsonl.

    scripts/plot_run.py RUN_DIR [RUN_DIR ...] [--out FILE.png]

Panels: train and validation loss against tokens; learning rate; gradient norm; loss scale;
tokens/s; MFU; and the step time broken down as the log reports it (data, forward, backward,
optimizer, pipeline wait, checkpoint stall, and the rest), stacked, for the first run, with its
exposed communication as a line (time blocked in collectives, which falls inside the phases)
and the other runs' step times as lines. Non-finite values (a skipped step's norm, logged as
null) are left out of the lines. Several runs are overlaid, each in its
own colour. The image goes to --out (default: RUN_DIR/dashboard.png of the first run).

Bad input (a directory without metrics.jsonl, a line that is not JSON, a run without steps) is
one line on stderr naming the file (and line), exit 2.
"""
import argparse
import json
import math
import os
import sys

WIDTH_IN, HEIGHT_IN, DPI = 16, 9, 100  # a 1600 x 900 image

# The stacked phases: (metrics.jsonl key, label). The checkpoint stall comes from its own
# records (a checkpoint is written between steps: its stall is charged to the step before it).
PHASES = [
    ("data_ms", "data"),
    ("forward_ms", "forward"),
    ("backward_ms", "backward"),
    ("optimizer_ms", "optimizer"),
    ("pipe_wait_ms", "pipeline wait"),
    ("checkpoint_stall_ms", "checkpoint stall"),
]


class BadInput(Exception):
    pass


def read_run(run_dir):
    """The run's step records, validation losses (by tokens) and checkpoint stalls (by step)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise BadInput(f"{path}: no such file (expected a run directory with metrics.jsonl)")
    steps, val, stalls = {}, [], {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}:{number}: not a JSON record ({e.msg})") from None
            if not isinstance(record, dict) or "step" not in record:
                continue
            # metrics.jsonl writes NaN and the infinities as null: not a number to draw.
            record = {k: (math.nan if v is None else v) for k, v in record.items()}
            if "loss" in record and "ms" in record:
                steps[record["step"]] = record  # a rolled-back step's second try replaces it
            elif "val_loss" in record:
                val.append((record["step"], record["val_loss"]))
            elif "checkpoint_stall_ms" in record:
                stalls[record["step"] - 1] = stalls.get(record["step"] - 1, 0) + \
                    record["checkpoint_stall_ms"]
    if not steps:
        raise BadInput(f"{path}: no step records (has the run trained a step?)")
    ordered = [steps[s] for s in sorted(steps)]
    # Validation runs before step s: the tokens trained by then are step s - 1's.
    tokens_at = {r["step"]: r["tokens"] for r in ordered}
    val_points = [(tokens_at.get(s - 1, 0), v) for s, v in sorted(val)]
    return {"name": os.path.basename(os.path.normpath(run_dir)), "steps": ordered,
            "val": val_points, "stalls": stalls}


def plot(runs, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    (loss_ax, lr_ax, norm_ax, scale_ax), (tps_ax, mfu_ax, time_ax, spare_ax) = axes
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colours[i % len(colours)]
        steps = run["steps"]
        x = [r["step"] for r in steps]
        loss_ax.plot([r["tokens"] for r in steps], [r["loss"] for r in steps], color=c,
                     alpha=0.6, lw=1, label=f"{run['name']} train")
        if run["val"]:
            loss_ax.plot([t for t, _ in run["val"]], [v for _, v in run["val"]], "o-",
                         color=c, ms=3, label=f"{run['name']} val")
        lr_ax.plot(x, [r["lr"] for r in steps], color=c, label=run["name"])
        norm_ax.plot(x, [r["grad_norm"] for r in steps], color=c, lw=1, label=run["name"])
        scale_ax.plot(x, [r.get("loss_scale", 1.0) for r in steps], color=c, label=run["name"])
        tps_ax.plot(x, [r["tokens_per_s"] for r in steps], color=c, lw=1, label=run["name"])
        mfu_ax.plot(x, [100 * r["mfu"] for r in steps], color=c, lw=1, label=run["name"])
        total = [r["ms"] + run["stalls"].get(r["step"], 0) for r in steps]
        if i == 0:
            layers, labels = [], []
            for key, label in PHASES:
                if key == "checkpoint_stall_ms":
                    values = [run["stalls"].get(r["step"], 0) for r in steps]
                else:
                    values = [r.get(key, 0) for r in steps]
                layers.append(values)
                labels.append(label)
            rest = [max(0.0, t - sum(v[j] for v in layers)) for j, t in enumerate(total)]
            layers.append(rest)
            labels.append("rest")
            time_ax.stackplot(x, layers, labels=labels, alpha=0.8)
            time_ax.plot(x, [r.get("comm_exposed_ms", 0) for r in steps], color="black", lw=1,
                         ls="--", label="exposed communication (within the phases)")
        else:
            time_ax.plot(x, total, color=c, lw=1, label=f"{run['name']} total")
    for ax, title, ylabel in [
        (loss_ax, "loss", "loss"), (lr_ax, "learning rate", "lr"),
        (norm_ax, "gradient norm", "norm"), (scale_ax, "loss scale", "scale"),
        (tps_ax, "throughput", "tokens/s"), (mfu_ax, "MFU", "% of peak"),
        (time_ax, f"step time ({runs[0]['name']} stacked)", "ms"),
    ]:
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("tokens" if ax is loss_ax else "step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if any(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
           for run in runs for r in run["steps"]):
        norm_ax.set_yscale("log")
    scale_ax.set_yscale("log")
    spare_ax.axis("off")
    spare_ax.text(0, 1, "\n".join(summary(run) for run in runs), va="top", family="monospace",
                  fontsize=8)
    fig.suptitle(", ".join(run["name"] for run in runs))
    fig.tight_layout()
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=DPI)
    os.replace(tmp, out)  # never a half-written image under the name


def summary(run):
    steps = run["steps"]
    last = steps[-1]
    tail = steps[len(steps) // 2:]  # the second half: past the warm-up
    def mean(key):
        values = [r.get(key, 0) for r in tail if math.isfinite(r.get(key, 0))]
        return sum(values) / len(values) if values else math.nan
    lines = [f"{run['name']}: {len(steps)} steps, {last['tokens']} tokens",
             f"  last loss {last['loss']:.4f}"
             + (f", val {run['val'][-1][1]:.4f}" if run["val"] else ""),
             f"  {mean('tokens_per_s'):.0f} tokens/s, MFU {100 * mean('mfu'):.1f}%,"
             f" {mean('ms'):.1f} ms/step"]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", help="the PNG to write (default: RUN_DIR/dashboard.png)")
    args = parser.parse_args()
    try:
        runs = [read_run(d) for d in args.runs]
    except BadInput as e:
        print(f"plot_run.py: {e}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.runs[0], "dashboard.png")
    plot(runs, out)
    print(f"plot_run.py: wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
