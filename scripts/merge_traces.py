#!/usr/bin/env python3
"""Joins the per-rank traces of a profiled run ([profile] steps: RUN_DIR/trace/rank_<r>.json) into
one trace-event file that chrome://tracing and ui.perfetto.dev open, a process per rank (the
ranks of one node share its monotonic clock, so their events line up).

    scripts/merge_traces.py RUN_DIR [--out FILE]    (default: RUN_DIR/trace/all_ranks.json)
"""
import argparse
import json
import os
import re
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out")
    args = ap.parse_args()
    trace_dir = os.path.join(args.run_dir, "trace")
    ranks = []
    if os.path.isdir(trace_dir):
        for name in os.listdir(trace_dir):
            m = re.fullmatch(r"rank_(\d+)\.json", name)
            if m:
                ranks.append((int(m.group(1)), os.path.join(trace_dir, name)))
    if not ranks:
        print(f"merge_traces.py: no trace/rank_<r>.json in {args.run_dir} (was it run with "
              "[profile] steps?)", file=sys.stderr)
        return 2
    events = []
    for rank, path in sorted(ranks):
        try:
            with open(path) as f:
                events += json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError) as e:
            print(f"merge_traces.py: {path}: not a trace-event file ({e})", file=sys.stderr)
            return 2
    out = args.out or os.path.join(trace_dir, "all_ranks.json")
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    print(f"merge_traces.py: {len(ranks)} ranks, {len(events)} events -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
