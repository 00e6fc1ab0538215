"""trainer_bench --ops: each operator's share of a real W-S step is reported, and only when asked.

Fails when the observer is not installed (no "ops"), records nothing (missing operators), or
counts calls outside the timed steps (the cross-entropy runs once a step: one pass, as a training
step on one rank holding the whole vocabulary makes it)."""
import json
import subprocess
import sys


def bench(*extra):
    out = subprocess.run([sys.argv[1], "--workload", "W-S", "--warmup", "1", "--steps", "1",
                          "--threads", "2", *extra], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


plain = bench()
assert "ops" not in plain, "ops reported without --ops"
run = bench("--ops")
ops = run["ops"]
for name in ("matmul_forward", "matmul_backward", "attention_forward", "attention_backward",
             "crossentropy_stats_and_backward", "layernorm_forward", "adamw_update"):
    assert name in ops, f"{name} missing from {sorted(ops)}"
for name in ("matmul_forward", "attention_backward"):
    assert ops[name]["gflops"] > 0, (name, ops[name])
assert "gflops" not in ops["adamw_update"], ops["adamw_update"]
one_pass = ops["crossentropy_stats_and_backward"]
assert one_pass["calls_per_step"] == 1, one_pass
for name in ("crossentropy_stats", "crossentropy_backward"):  # the two passes it replaces
    assert name not in ops, f"{name} in a training step: {sorted(ops)}"
# PaLM's count charges attention its full square: 6 L C T a token more (W-S: 6 x 6 x 384 x 256).
extra = (run["mfu_palm"] - run["mfu"]) / run["mfu"] * run["flops_per_token"]
assert abs(extra - 6 * 6 * 384 * 256) < 1, (extra, run["mfu"], run["mfu_palm"])
total = sum(o["ms_per_step"] for o in ops.values())
assert 0 < total <= run["ms_per_step"] * 1.05, (total, run["ms_per_step"])
print(f"ok: {len(ops)} operators, {total:.0f} of {run['ms_per_step']:.0f} ms a step")
