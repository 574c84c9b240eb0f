"""benchmarks/gpu/check.py, the one-shot check a lent GPU runs first, in its CPU dry run: every
step runs (or says why it cannot), the server path's states equal the hooks', and it imports
nothing the GPU image lacks (polars, the validation stack)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # builds two tiny targets and serves one (~30 s)

CHECK = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "check.py"


def test_the_dry_run_runs_every_step_and_the_server_states_equal_the_hooks(tmp_path):
    out = tmp_path / "results" / "gpu_check.json"
    done = subprocess.run([sys.executable, str(CHECK), "--cpu", "--out", str(out),
                           "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    steps = doc["steps"]
    assert doc["mode"] == "cpu dry run" and doc["imported_heavy_modules"] == []
    assert "linear_attention" in steps["targets"]["hybrid"]["layer_types"]
    for kind in ("dense", "hybrid"):
        speed = steps["extract_speed"][kind]
        assert speed["tokens"] > 0 and speed["hooks_tokens_per_s"] > 0
        served = steps["server_states"][kind]
        assert served["dev_server"]["failed_rows"] == 0
        assert served["dev_server"]["max_abs_diff"] <= 1e-5
        assert served["dev_server"]["zero_layers"] == [] and not served["dev_server"]["nonfinite"]
        assert "vllm" in served["vllm"]["skipped"]
    assert "skipped" in steps["regenerate_vllm"] and "skipped" in steps["nccl_train"]
    assert [p.name for p in out.parent.iterdir()] == ["gpu_check.json"]  # weights stay in --work
