"""benchmarks/gpu_run.py, the prepared GPU run, in its smoke mode: the same sections at tiny shapes on
this CPU, so that the script a lent GPU gets in its first minute has run in CI and cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_run  # noqa: E402


def run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_run.py"), "--smoke", "--commit", "abc1234",
                           "--out", str(out), "--tokenizer", str(tmp_path / "tokenizer"), *flags],
                          capture_output=True, text=True, timeout=1200, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    return done, results


def test_every_section_runs_and_reports(tmp_path):
    """Each section in its own process; results.json, results.md and log.txt hold every section's figures
    and the commit. The figures are checked where a smoke run can check them: steady decode batches, no
    compilation after warm-up (engine and server), greedy parity with HF torch in float32, the bench
    clients' requests all completed, ngram speculation's counters present."""
    done, results = run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    sections = results["sections"]
    assert list(sections) == list(gpu_run.SECTIONS) and not any("error" in s for s in sections.values()), sections
    assert results["machine"]["commit"] == "abc1234"

    step = sections["step"]["result"]
    assert step["compilations_since_warmup"] == 0 and step["offline"]["output_tokens"] == 16 * 8
    for r in step["steps"]:  # every timed step ran the whole batch: one decode bucket, the batch's own
        assert r["buckets_run"] == {f"decode {r['batch']}": r["decode_steps"]}, r
        assert r["step_ms"] > 0 and 0 < r["device_busy"] <= 1 and r["floor_ms"] > 0
    assert {(r["batch"], r["async_scheduling"]) for r in step["steps"]} == {(1, False), (1, True), (4, False), (4, True)}
    staged = step["staged_inputs"]  # the launch experiment: numpy, device with none held, with 2 held
    assert [(r["batch"], r["held"]) for r in staged] == [(b, h) for b in (1, 4) for h in (None, 0, 2)]
    assert all(r["buckets_run"] == {f"decode {r['batch']}": r["decode_steps"]} for r in staged), staged
    profile = step["profile"]  # the steady largest batch's trace, read back: its busiest line has events
    assert profile["batch"] == 4 and profile["steps"] == 8 and "error" not in profile, profile
    assert max(line["ms_per_step"] for line in profile["lines"]) > 0 and all(line["top"] for line in profile["lines"])

    parity = sections["parity"]["result"]
    assert parity["float32"]["equal_prompts"] == parity["num_prompts"]
    assert parity["float32"]["max_logprob_diff_on_agreed_tokens"] < 1e-3
    assert "bfloat16" in parity

    kernels = sections["kernels"]["result"]
    assert kernels["interpreted"] and all(r["finite"] and r["rel_error"] < 1e-2 for r in kernels["cases"])
    llama8b = sections["llama8b"]["result"]
    assert llama8b["compilations_since_warmup"] == 0 and len(llama8b["ttft_ms"]) == 2

    server = sections["server"]["result"]
    assert server["compilations_since_warmup"] == 0
    for name in ("c64", "c32_json_0", "c32_json_0.5", "grounded_c1"):
        assert server[name]["failed"] == 0 and server[name]["completed"] > 0, (name, server[name])
    ngram = sections["ngram"]["result"]["grounded_c1"]
    assert ngram["failed"] == 0 and any(key.startswith("spec_") for key in ngram), ngram
    assert sections["pytest"]["result"]["returncode"] == 0
    quant = sections["quant"]["result"]  # each setting's engine ran its one decode bucket, compiled nothing more
    assert [(r["name"], r["batch"]) for r in quant["runs"]] == [("bf16", 1), ("fp8 weights", 1), ("bf16", 4), ("fp8 KV", 4)]
    for r in quant["runs"]:
        assert r["buckets_run"] == {f"decode {r['batch']}": 8} and r["compilations_since_warmup"] == 0, r
        assert r["device_ms"] > 0
    fp8, bf16 = quant["runs"][1], quant["runs"][0]
    assert fp8["gemms"]["instructions with f8e4m3fn operands"] > 0 and fp8["weight_bytes"] < bf16["weight_bytes"]
    assert quant["runs"][3]["kv_cache_bytes"] * 2 == quant["runs"][2]["kv_cache_bytes"]
    assert quant["fp8_weights_speedup_b1"] > 0 and quant["fp8_kv_speedup_b64"] > 0

    out = tmp_path / "out"
    table = (out / "results.md").read_text()
    assert "commit abc1234" in table and "| step B=4 ctx 20 async on |" in table and "| parity float32 | 4/4" in table
    assert "[server]" in (out / "log.txt").read_text()


def test_a_spent_deadline_records_every_section_as_not_started(tmp_path):
    done, results = run(tmp_path, "--deadline-s", "1", "--only", "ceilings", "step")
    assert done.returncode == 1
    assert {name: s["error"].split(":")[0] for name, s in results["sections"].items()} == \
        {"ceilings": "not started", "step": "not started"}


def test_a_stopped_section_reports_what_it_measured():
    """A section stopped by its time box keeps the measurements it saved; the summary shows them."""
    sections = {
        "step": {"seconds": 140.0, "error": "ran out of its 140 s",
                 "partial": {"steps": [{"batch": 1, "context": 300, "async_scheduling": True, "step_ms": 2.5,
                                        "device_ms": 2.4, "device_busy": 0.96, "host_ms": 1.0,
                                        "step_over_floor": 1.7, "floor_ms": 1.46}]}},
        "llama8b": {"seconds": 3.0, "error": "exited with 1"},
    }
    rows = gpu_run.summary_rows(sections)
    assert rows[0] == ("step", "ERROR: ran out of its 140 s; what it measured:")
    assert rows[1][0] == "step B=1 ctx 300 async on" and rows[1][1].startswith("2.50 ms, device 2.40")
    assert rows[2] == ("llama8b", "ERROR: exited with 1")
