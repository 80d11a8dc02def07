"""The small-GPT run of benchmarks/bench_distributed.py that the sharded FP8 GPU tests check (a helper, no tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_gpt_rows(out: Path, runs: list[str], *extra: str, keep_as: str = "") -> dict:
    """Run ``runs`` on a small GPT for 200 steps (an inf in a gradient at steps 5 and 11 and in the first FP8 layer's
    input at step 8 on the last rank; resume runs saved at step 100); returns the rows by run name.

    With ``MP_RESULTS_DIR`` set, the table and rows are copied there (prefixed ``keep_as``): the GPU visit's evidence.
    """
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "bench_distributed.py"),
        "--vocab", "512", "--hidden", "256", "--layers", "2", "--heads", "4", "--seq", "128",
        "--global-batch", "8", "--steps", "200", "--warmup", "20", "--lr", "1e-3",
        "--poison-steps", "5", "11", "--act-poison-steps", "8", "--resume-at", "100",
        "--loss-rtol", "0.01", "--loss-window", "10", "--fp8-options", json.dumps({"size_rule": "off"}),
        *extra, "--out", str(out), "--tag", "test", "--runs", *runs,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    print(proc.stdout[-4000:])
    if os.environ.get("MP_RESULTS_DIR"):
        for f in out.iterdir():
            (Path(os.environ["MP_RESULTS_DIR"]) / (keep_as + f.name)).write_bytes(f.read_bytes())
    result = {r["run"]: r for r in json.loads((out / "bench_distributed_test.json").read_text())["rows"]}
    assert proc.returncode == 0 or result, proc.stdout[-3000:] + proc.stderr[-3000:]
    return result
