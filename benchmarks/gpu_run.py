"""The prepared GPU run: every GPU figure the project reports, from one command, inside one device call.

    python benchmarks/gpu_run.py --commit SHA [--out DIR] [--deadline-s 450] [--only SECTION ...]
    python benchmarks/gpu_run.py --smoke            # the same code at tiny shapes on a CPU (CI runs it)
    python benchmarks/gpu_run.py --prepare          # here, before the call: the tokenizer the run carries

A GPU is lent by chance, for minutes, with no network. So the run is one script that any session can
start in its first minute: each section runs in its own process under its own time box (one that fails
or runs out of time records its error and the run goes on), all under one deadline, and every result
lands in DIR (default $OUT, else benchmarks/results/gpu/latest) as results.json, results.md and
log.txt, with the card, driver, JAX version and commit. A short table is printed last.

Sections, in the order they run (the most wanted first, as a late one may meet the deadline):
  ceilings   a device-to-device copy (bytes read + written) and a large bf16 matmul, measured here
  kernels    the ragged prefill kernel on 4x1024 and 2x4096 (TFLOP/s against the matmul ceiling),
             two decode cases against their KV-bytes floor, XLA's attention beside each
  step       SmolLM2-1.7B's shape, random bf16 weights made on the device (--load-format dummy):
             the decode step at batch 1/32/128, contexts ~300 and ~2,000, asynchronous scheduling off
             and on: host phases, wall, device time, busy share, the floor from bytes moved, MBU, MFU;
             the launch phase with the inputs put on the device first, none or the last 2 steps'
             kept (ModelRunner.hold_staged_inputs), against numpy inputs, at batch 1 and 128;
             a profiler trace of 8 steps at batch 128, context ~300, read back there: the device's
             ms per step on each of its lines and the 12 largest kernels or ops (results.json);
             then offline throughput, 256 prompts of 32..512 tokens, 128 out (the 7,276 tok/s workload)
  parity     a random Hugging Face Llama saved by the image's transformers, loaded by jaxserve: greedy
             tokens and the chosen tokens' logprobs against HF torch on the same GPU, float32 and bf16
  server     `jaxserve serve` on the 1.7B shape, `jaxserve bench serve` at concurrency 64 (random 256
             in / 128 out), JSON schemas on half the requests at concurrency 32 against none, grounded
             prompts at concurrency 1; compilations after warm-up from /metrics
  pytest     `pytest -m "gpu or not slow"` over the kernel, engine-kernel and sampler test files
  ngram      a second server with ngram speculation, the same grounded prompts at concurrency 1 (random
             weights do not copy from their prompts: on the H200 it drafted nothing, so this times
             speculation's overhead, not its gain)
  quant      the 8B shape's decode step, the device's ms, with fp8 weights against bfloat16 at batch 1 and
             fp8 KV pages against bfloat16 pages at batch 64, context 4,096 (issue 37's GPU points), and
             the GEMMs XLA compiled the fp8 step's dots to; four small engines of two executables each
  llama8b    Llama-3-8B's shape with no flags but --load-format dummy: the start-up memory plan,
             decode steps at batch 1 and 64, TTFT of a 4,096-token prompt

The first call runs the sections up to ngram (--part first; on the H200 they took 498 s of a 570 s
deadline), a second call the 8B shape's (--part second), whose default engine alone took 170 s to start.

The server sections need the wheels the GPU image lacks (benchmarks/gpu_wheels.py gathers them into
.whl/; the call installs them with pip --no-index first). Sections share one persistent compilation
cache, so a server on the step section's shape loads its executables instead of compiling them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

DEFAULT_TOKENIZER = REPO / ".gpu" / "tokenizer"  # --prepare writes it; the call carries .gpu
START = time.perf_counter()

# SmolLM2's Llama config, with the shapes below laid over it (the tokenizer is SmolLM2's: 49,152 ids)
BASE_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                   rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                   eos_token_id=2, vocab_size=49152, attention_bias=False, mlp_bias=False, torch_dtype="bfloat16")
SHAPES = {
    "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, head_dim=64, rope_theta=130000.0),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, rope_theta=500000.0, vocab_size=128256,
                       tie_word_embeddings=False, max_position_embeddings=8192),
    # parity: Llama-3's attention layout (GQA 4, head_dim 64) at a size saved and reloaded in seconds
    "parity": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, initializer_range=0.1, max_position_embeddings=512),
}


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", flush=True)


# ----------------------------------------------------------------------------------------------
# What every section shares


class Context:
    """A section's settings: smoke or not, its work folder (shared by the run's sections), the tokenizer."""

    def __init__(self, args: argparse.Namespace):
        self.smoke = args.smoke
        self.workdir = Path(args.workdir)
        self.tokenizer = Path(args.tokenizer)
        self.section = args.section
        self.box = args.section_box  # this section's time box, seconds

    def save(self, result: dict) -> None:
        """The section's results so far: a section stopped by its time box still reports what it measured."""
        path = self.workdir / f"{self.section}.json"
        path.with_suffix(".part").write_text(json.dumps(result, indent=2, default=str))
        path.with_suffix(".part").replace(path)

    def shape(self, name: str) -> str:
        return "tiny" if self.smoke else name

    def model_dir(self, shape: str) -> Path:
        """A Hugging Face directory holding only a config and the tokenizer (weights: --load-format dummy)."""
        path = self.workdir / f"model-{shape}"
        if not (path / "config.json").exists():
            path.mkdir(parents=True, exist_ok=True)
            for item in self.tokenizer.iterdir():
                (path / item.name).write_bytes(item.read_bytes())
            (path / "config.json").write_text(json.dumps(BASE_CONFIG | SHAPES[shape], indent=2))
        return path

    def ceilings(self) -> dict:
        """The ceilings section's figures, or small measurements of them if it did not run."""
        path = self.workdir / "ceilings.json"
        if path.exists():
            return json.loads(path.read_text())
        return measure_ceilings(small=True)


def measure_ceilings(small: bool) -> dict:
    import bench_kernels
    import jax

    copy = bench_kernels.copy_bandwidth(2**20, 5) if small else bench_kernels.copy_bandwidth(2**29, 20)
    matmul = bench_kernels.matmul_rate(256, 5) if small else bench_kernels.matmul_rate(8192, 20)
    return {"copy_bytes_per_s": copy, "matmul_flops_per_s": matmul, "device": jax.devices()[0].device_kind}


def random_prompts(rng, count: int, length: int, vocab: int = 49152) -> "list[list[int]]":
    return rng.integers(100, vocab, (count, length)).tolist()


# The step section's engine, which the server sections start too (so they load its executables from the cache)
STEP_SETTINGS = {False: dict(dtype="bfloat16", max_num_seqs=128, max_num_batched_tokens=2048),
                 True: dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, num_kv_pages=256)}


def engine_llm(ctx: Context, shape: str, **settings):
    """`jaxserve.LLM` on `shape` with random weights made on the device."""
    from jaxserve import LLM

    start = time.perf_counter()
    log(f"starting an engine on the {shape} shape")
    llm = LLM(str(ctx.model_dir(shape)), load_format="dummy", **settings)
    compile_s = llm.warmup_summary["seconds"] if llm.warmup_summary else 0.0
    log(f"engine ready in {time.perf_counter() - start:.1f} s, {compile_s:.1f} s of it warm-up")
    return llm


def model_costs(engine, batch: int, context: int) -> dict:
    """A decode step's bytes (every weight once, every cached K/V of the batch once) and FLOPs."""
    cfg, runner = engine.model_cfg, engine.runner
    kv_bytes_per_token = runner.kv_cache_bytes / (runner.num_pages * engine.cfg.page_size)
    num_params = runner.device_weight_bytes / (2 if engine.cfg.dtype == "bfloat16" else 4)
    attention_flops = 4 * batch * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return {"bytes": runner.device_weight_bytes + batch * context * kv_bytes_per_token,
            "flops": 2 * num_params * batch + attention_flops}


# ----------------------------------------------------------------------------------------------
# Sections: each returns a JSON-able dict


def section_ceilings(ctx: Context) -> dict:
    ceilings = measure_ceilings(small=ctx.smoke)
    log(f"copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    return ceilings


def section_kernels(ctx: Context) -> dict:
    import bench_kernels
    import jax
    from bench_kernels import Case

    ceilings = ctx.ceilings()
    interpret = jax.default_backend() != "gpu"
    cases = bench_kernels.SMOKE_CASES if ctx.smoke else [
        Case("prefill", 4, 1024, 2048, 32, 8, 128), Case("prefill", 2, 4096, 4096, 32, 8, 128),
        Case("prefill", 8, 512, 512, 32, 32, 64),  # the 1.7B shape's heads
        Case("decode", 256, 1, 2048, 32, 8, 128), Case("decode", 128, 1, 2048, 32, 32, 64)]
    results = []
    for i, case in enumerate(cases):
        r = bench_kernels.run_case(case, seed=i, repeats=1 if ctx.smoke else 10, interpret=interpret)
        if case.kind == "prefill":
            r["tflops"] = case.flops() / (r["pallas_ms"] / 1e3) / 1e12
            r["share_of_matmul"] = case.flops() / (r["pallas_ms"] / 1e3) / ceilings["matmul_flops_per_s"]
        else:
            r["share_of_copy_floor"] = case.kv_bytes() / ceilings["copy_bytes_per_s"] / (r["pallas_ms"] / 1e3)
        checked = (f"rel error {r['rel_error']:.1e}" if "rel_error" in r else
                   "not checked (the dense reference would not fit), output finite" if r["finite"] else "NOT FINITE")
        share = (f"{r['share_of_matmul']:.0%} of the matmul rate" if "tflops" in r else
                 f"{r['share_of_copy_floor']:.0%} of the copy floor")
        log(f"{case.name}: pallas {r['pallas_ms']:.3f} ms, xla {r['xla_ms']:.3f} ms, {checked}, {share}")
        results.append(r)
        ctx.save({"cases": results, "interpreted": interpret})
    return {"cases": results, "interpreted": interpret}


def _offline(ctx: Context, llm, rng, result: dict) -> None:
    """Offline throughput: 256 prompts of 32..512 random tokens, 128 greedy tokens each, EOS ignored."""
    from jaxserve import SamplingParams

    engine = llm.engine
    count, out_len, (lo, hi) = (16, 8, (8, 40)) if ctx.smoke else (256, 128, (32, 512))
    prompts = [{"prompt_token_ids": random_prompts(rng, 1, int(n))[0]} for n in rng.integers(lo, hi + 1, count)]
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    steps = engine.num_steps
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result["offline"] = {"num_prompts": count, "input_tokens": sum(len(o.prompt_token_ids) for o in outputs),
                         "output_tokens": num_out, "seconds": seconds, "output_tok_s": num_out / seconds,
                         "num_steps": engine.num_steps - steps}
    result["compilations_since_warmup"] = engine.num_compilations_since_warmup
    log(f"offline: {num_out} tokens in {seconds:.2f} s = {num_out / seconds:.0f} output tok/s; "
        f"{result['compilations_since_warmup']} compilations after warm-up")
    ctx.save(result)


def _device_profile(ctx: Context, engine, prompts: "list[list[int]]", steps: int) -> dict:
    """Where a steady decode step's time goes on the device: a profiler trace of `steps` engine steps
    (asynchronous scheduling on, every request decoding), read back with jax.profiler.ProfileData. Per
    line of each device plane (on a GPU: its streams and XLA's op and module lines; on a CPU, the smoke
    run, the host's XLA client lines), the line's busy ms per step and its 12 largest event names."""
    import collections
    import shutil

    import jax
    from jax.profiler import ProfileData
    from jaxserve import SamplingParams

    engine.async_scheduling = True
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while not all(r.output_token_ids for r in requests):
        engine.step()
    for _ in range(3):
        engine.step()
    trace_dir = ctx.workdir / "trace"
    jax.profiler.start_trace(str(trace_dir))
    try:
        for _ in range(steps):
            engine.step()
    finally:
        jax.profiler.stop_trace()
    for request in requests:
        engine.abort_request(request.request_id)
    while engine.has_unfinished:
        engine.step()
    engine.pool.reset_prefix_cache()
    path = max(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    profile = ProfileData.from_file(str(path))  # read once; its planes live as long as it
    planes = list(profile.planes)
    device = "/device:GPU" if any(p.name.startswith("/device:GPU") for p in planes) else "/host:CPU"
    lines = []
    for plane in planes:
        if not plane.name.startswith(device):
            continue
        for line in plane.lines:
            if line.name == "python":  # the host's Python calls (the CPU's plane): the engine, not the device
                continue
            totals = collections.Counter()
            for event in line.events:
                totals[event.name] += event.duration_ns
            if totals:
                lines.append({"plane": plane.name, "line": line.name,
                              "ms_per_step": sum(totals.values()) / 1e6 / steps,
                              "top": [(name, ns / 1e6 / steps) for name, ns in totals.most_common(12)]})
    shutil.rmtree(trace_dir, ignore_errors=True)
    return {"batch": len(prompts), "context": len(prompts[0]), "steps": steps, "lines": lines}


def _staged_inputs(ctx: Context, engine, rng, result: dict, batches, context: int, decode_steps: int) -> None:
    """The launch phase with the step's inputs put on the device first (ModelRunner.hold_staged_inputs):
    none of them kept after their step (0), or the last 2 steps' kept alive (2), against numpy inputs in
    the same run; asynchronous scheduling on, the smallest and largest batch at the short context."""
    import numpy as np
    from bench_steps import engine_phases

    runner = engine.runner
    result["staged_inputs"] = []
    for batch in (batches[0], batches[-1]):
        for held in (None, 0, 2):
            runner.hold_staged_inputs = held
            try:
                r = engine_phases(engine, np.asarray(random_prompts(rng, batch, context)), decode_steps, True,
                                  device_repeats=16)
            finally:
                runner.hold_staged_inputs = None
                runner.staged_inputs.clear()
            engine.pool.reset_prefix_cache()
            result["staged_inputs"].append(r | {"batch": batch, "context": context, "held": held})
            ctx.save(result)
            log(f"B={batch} ctx={context} inputs {'numpy' if held is None else f'on the device, {held} held'}: "
                f"step {r['step_ms']:.2f} ms, launch {r['phase_ms']['launch']:.2f} ms, device {r['device_ms']:.2f}")


def section_step(ctx: Context) -> dict:
    import numpy as np
    from bench_steps import engine_phases

    ceilings = ctx.ceilings()
    batches, contexts, decode_steps = ((1, 4), (20,), 6) if ctx.smoke else ((1, 32, 128), (300, 2000), 32)
    llm = engine_llm(ctx, ctx.shape("smollm2-1.7b"), **STEP_SETTINGS[ctx.smoke])
    engine = llm.engine
    result = {"warmup": llm.warmup_summary, "num_pages": engine.runner.num_pages - 1,
              "attention_backend": engine.runner.attention_backend, "steps": []}
    log(f"warm-up: {llm.warmup_summary['num_executables']} executables in {llm.warmup_summary['seconds']:.1f} s "
        f"({llm.warmup_summary['num_cache_hits']} from the cache); {result['num_pages']} KV pages")
    ctx.save(result)
    rng = np.random.default_rng(0)
    for i, context in enumerate(contexts):
        if i == 1:  # before the long contexts, which a time box may cut
            _offline(ctx, llm, rng, result)
        for batch in batches:
            if batch * engine.pool.pages_needed([], context + decode_steps) > result["num_pages"]:
                result["steps"].append({"batch": batch, "context": context, "error": "the KV pool is too small"})
                continue
            for async_scheduling in (False, True):
                prompts = np.asarray(random_prompts(rng, batch, context))
                r = engine_phases(engine, prompts, decode_steps, async_scheduling, device_repeats=16)
                engine.pool.reset_prefix_cache()
                costs = model_costs(engine, batch, context + decode_steps // 2)
                floor_ms = 1e3 * costs["bytes"] / ceilings["copy_bytes_per_s"]
                r |= {"batch": batch, "context": context, "floor_ms": floor_ms,
                      "step_over_floor": r["step_ms"] / floor_ms,
                      "mbu": floor_ms / r["step_ms"],
                      "mfu": costs["flops"] / (r["step_ms"] / 1e3) / ceilings["matmul_flops_per_s"]}
                result["steps"].append(r)
                ctx.save(result)
                phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phase_ms"].items())
                log(f"B={batch} ctx={context} async={'on' if async_scheduling else 'off'}: step {r['step_ms']:.2f} ms "
                    f"(device {r['device_ms']:.2f}, busy {r['device_busy']:.0%}, floor {floor_ms:.2f}, host "
                    f"{r['host_ms']:.2f}: {phases})")
        if i == 0:  # the launch phase's experiment, then where the issue's step's device time goes
            _staged_inputs(ctx, engine, rng, result, batches, context, decode_steps)
            try:
                result["profile"] = _device_profile(ctx, engine, random_prompts(rng, batches[-1], context), steps=8)
                busiest = max(result["profile"]["lines"], key=lambda line: line["ms_per_step"])
                log(f"profile B={batches[-1]} ctx={context}: {busiest['line']} {busiest['ms_per_step']:.2f} ms a step; "
                    + ", ".join(f"{name} {ms:.3f}" for name, ms in busiest["top"][:6]))
            except Exception as e:  # noqa: BLE001 - a profiler that fails must not cost the figures after it
                result["profile"] = {"error": f"{type(e).__name__}: {e}"}
                log(f"profile failed: {result['profile']['error']}")
            ctx.save(result)
    if len(contexts) == 1:
        _offline(ctx, llm, rng, result)
    return result


def section_parity(ctx: Context) -> dict:
    import gc

    import numpy as np
    import torch
    import transformers
    from jaxserve import LLM, SamplingParams

    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"  # torch's model and activations share the GPU
    shape = ctx.shape("parity")
    path = ctx.workdir / "parity-hf"
    config = BASE_CONFIG | SHAPES[shape]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config),
                                                          dtype=torch.float32)
    # A trained model's next token usually stands out; a random one's does not (its top two logprobs were
    # within bf16's rounding of each other on an H100). Embeddings of std 0.25 (the LM head is tied to
    # them) spread the logits (std ~8 at hidden 1024) so greedy choices stand out, without saturating the
    # chosen tokens' logprobs, while every layer still decides which token wins.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.25 / config.get("initializer_range", 0.02))
    model.save_pretrained(path)
    for item in ctx.tokenizer.iterdir():
        (path / item.name).write_bytes(item.read_bytes())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_prompts, prompt_len, new_tokens = (4, 12, 8) if ctx.smoke else (16, 24, 32)
    prompts = random_prompts(np.random.default_rng(1), num_prompts, prompt_len)
    result = {"num_prompts": num_prompts, "new_tokens": new_tokens, "torch_device": device}
    for dtype in ("float32", "bfloat16"):
        hf = model.to(device=device, dtype=getattr(torch, dtype))
        hf.generation_config.eos_token_id = None  # generate every token, as ignore_eos does below
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompts, device=device), max_new_tokens=new_tokens, do_sample=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        hf_tokens = out.sequences[:, prompt_len:].tolist()
        hf_logprobs = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)  # [N, T, V]
        # Two executables: every prompt in one step of 512 tokens, every decode step of num_prompts rows; a
        # small pool, as the next dtype's engine may come while this one's pages linger
        llm = LLM(str(path), dtype=dtype, max_num_seqs=num_prompts, max_num_batched_tokens=512, max_model_len=128,
                  num_kv_pages=256, min_prefill_bucket=512, min_decode_bucket=num_prompts)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
        rows, max_logprob_diff = [], 0.0
        for i, o in enumerate(outs):
            ours = o.outputs[0].token_ids
            agree = next((t for t in range(new_tokens) if ours[t] != hf_tokens[i][t]), new_tokens)
            for t in range(agree):
                theirs = float(hf_logprobs[i, t, ours[t]])
                max_logprob_diff = max(max_logprob_diff, abs(o.outputs[0].logprobs[t][ours[t]] - theirs))
            row = {"prompt": i, "equal": agree == new_tokens, "first_difference": None if agree == new_tokens else agree}
            if agree < new_tokens:  # a bf16 tie shows as two near-equal logprobs at the first difference
                row |= {"ours": ours[agree], "hf": hf_tokens[i][agree],
                        "hf_logprob_of_ours": float(hf_logprobs[i, agree, ours[agree]]),
                        "hf_logprob_of_hf": float(hf_logprobs[i, agree, hf_tokens[i][agree]])}
            rows.append(row)
        equal = sum(r["equal"] for r in rows)
        result[dtype] = {"equal_prompts": equal, "max_logprob_diff_on_agreed_tokens": max_logprob_diff,
                         "rows": rows, "attention_backend": llm.engine.runner.attention_backend}
        ctx.save(result)
        log(f"{dtype}: greedy tokens equal on {equal}/{num_prompts} prompts, chosen-token logprobs within "
            f"{max_logprob_diff:.2e} of HF's ({llm.engine.runner.attention_backend} attention)")
        del llm
        gc.collect()
    return result


def section_llama8b(ctx: Context) -> dict:
    import numpy as np
    from bench_steps import engine_phases
    from jaxserve import SamplingParams

    # No flags: the GPU's defaults choose everything (the smoke run takes the step section's small engine,
    # whose executables it finds in the run's compilation cache)
    llm = engine_llm(ctx, ctx.shape("llama-3-8b"), **(STEP_SETTINGS[True] if ctx.smoke else {}))
    engine = llm.engine
    result = {"warmup": llm.warmup_summary, "max_num_seqs": engine.cfg.max_num_seqs,
              "max_num_batched_tokens": engine.cfg.max_num_batched_tokens, "max_model_len": engine.cfg.max_model_len,
              "num_pages": engine.runner.num_pages - 1, "kv_cache_bytes": engine.runner.kv_cache_bytes,
              "weight_bytes": engine.runner.device_weight_bytes, "dtype": engine.cfg.dtype, "steps": []}
    ctx.save(result)
    log(f"defaults: {result['max_num_seqs']} seqs, {result['max_num_batched_tokens']} tokens per step, "
        f"max_model_len {result['max_model_len']}, {result['num_pages']} pages; warm-up "
        f"{llm.warmup_summary['seconds']:.1f} s")
    rng = np.random.default_rng(2)
    for batch in (1, 4) if ctx.smoke else (1, 64):
        r = engine_phases(engine, np.asarray(random_prompts(rng, batch, 300 if not ctx.smoke else 20)),
                          decode_steps=8 if ctx.smoke else 32, async_scheduling=engine.async_scheduling,
                          device_repeats=8)
        engine.pool.reset_prefix_cache()
        result["steps"].append(r | {"batch": batch})
        ctx.save(result)
        log(f"B={batch}: step {r['step_ms']:.2f} ms, device {r['device_ms']:.2f} ms")
    prompt_len = 200 if ctx.smoke else 4096
    ttfts = []
    for _ in range(2):
        request = engine.add_request(random_prompts(rng, 1, prompt_len)[0],
                                     SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        while not request.output_token_ids:
            engine.step()
        ttfts.append(time.perf_counter() - start)
        while engine.has_unfinished:
            engine.step()
    result["ttft_ms"] = [1e3 * t for t in ttfts]
    result["compilations_since_warmup"] = engine.num_compilations_since_warmup
    log(f"TTFT of a {prompt_len}-token prompt: {', '.join(f'{1e3 * t:.0f}' for t in ttfts)} ms")
    return result


# The quant section's engines: one decode bucket each (B=1 at a short context, B=64 at 4,096), one prompt
# bucket, and a pool of the pages the batch needs (no pool sized from memory, so no compile to measure a
# step): two step executables an engine, so four engines on the 8B shape fit where one engine of the defaults'
# sixteen executables took 170 s to start
QUANT_CASES = {  # case: (engine settings, batch, context), the tiny shape's in smoke runs
    False: {"b1": (dict(max_num_seqs=1, max_num_batched_tokens=512, min_prefill_bucket=512, max_model_len=1024,
                        num_kv_pages=72), 1, 300),
            "b64": (dict(max_num_seqs=64, min_decode_bucket=64, max_num_batched_tokens=4096, min_prefill_bucket=4096,
                         max_model_len=4224, num_kv_pages=64 * 264 + 8), 64, 4096)},
    True: {"b1": (dict(max_num_seqs=1, max_num_batched_tokens=64, min_prefill_bucket=64, max_model_len=128,
                       num_kv_pages=16), 1, 20),
           "b64": (dict(max_num_seqs=4, min_decode_bucket=4, max_num_batched_tokens=128, min_prefill_bucket=128,
                        max_model_len=128, num_kv_pages=40), 4, 100)},
}
# (name, case, setting): each 8-bit setting beside bfloat16 at the point issue 37 names for it
QUANT_RUNS = [("bf16", "b1", {}), ("fp8 weights", "b1", {"quantization": "fp8"}),
              ("bf16", "b64", {}), ("fp8 KV", "b64", {"kv_cache_dtype": "fp8"})]


def _gemm_kinds(hlo_text: str) -> dict[str, int]:
    """What XLA compiled the step's matrix products to: cuBLAS(Lt) custom calls by target, and the
    instructions (fusions included) that take float8_e4m3 operands."""
    import collections
    import re

    kinds = collections.Counter(re.findall(r'custom_call_target="(__cublas[^"]*)"', hlo_text))
    kinds["instructions with f8e4m3fn operands"] = sum(
        1 for line in hlo_text.splitlines() if "=" in line and "f8e4m3fn[" in line.split("=", 1)[1])
    return dict(kinds)


def section_quant(ctx: Context) -> dict:
    """Issue 37's GPU points on the 8B shape: fp8 weights against bfloat16 at batch 1, fp8 KV pages against
    bfloat16 pages at batch 64 and context 4,096 (the device's ms per decode step, replayed), and which
    GEMMs XLA compiled the fp8 step's dots to."""
    import gc

    import numpy as np
    from bench_steps import engine_phases

    cases = QUANT_CASES[ctx.smoke]
    result: dict = {"shape": ctx.shape("llama-3-8b"), "runs": []}
    for name, case, setting in QUANT_RUNS:
        settings, batch, context = cases[case]
        label = f"{name} B={batch} ctx {context}"
        llm = engine_llm(ctx, result["shape"], dtype="bfloat16", **settings, **setting)
        engine = llm.engine
        rng = np.random.default_rng(3)
        r = engine_phases(engine, np.asarray(random_prompts(rng, batch, context)), decode_steps=8 if ctx.smoke else 16,
                          async_scheduling=True, device_repeats=8)
        run = {"label": label, "name": name, "case": case, "setting": setting, "batch": batch, "context": context,
               "step_ms": r["step_ms"], "device_ms": r["device_ms"], "buckets_run": r["buckets_run"],
               "warmup_s": llm.warmup_summary["seconds"], "weight_bytes": engine.runner.device_weight_bytes,
               "kv_cache_bytes": engine.runner.kv_cache_bytes,
               "compilations_since_warmup": engine.num_compilations_since_warmup}
        if setting.get("quantization"):
            run["gemms"] = _gemm_kinds(engine.runner.compiled_text("decode", batch))
        result["runs"].append(run)
        log(f"{label}: step {run['step_ms']:.2f} ms, device {run['device_ms']:.2f} ms, weights "
            f"{run['weight_bytes'] / 2**30:.2f} GiB, KV pages {run['kv_cache_bytes'] / 2**30:.2f} GiB"
            + (f"; GEMMs {run['gemms']}" if "gemms" in run else ""))
        ctx.save(result)
        del engine, llm
        gc.collect()
    device = {(run["name"], run["case"]): run["device_ms"] for run in result["runs"]}
    result["fp8_weights_speedup_b1"] = device["bf16", "b1"] / device["fp8 weights", "b1"]
    result["fp8_kv_speedup_b64"] = device["bf16", "b64"] / device["fp8 KV", "b64"]
    log(f"device ms per decode step, bfloat16 over 8-bit: fp8 weights at B=1 {result['fp8_weights_speedup_b1']:.2f}x "
        f"(issue 37 asks 1.6x), fp8 KV at B={cases['b64'][1]} ctx {cases['b64'][2]} "
        f"{result['fp8_kv_speedup_b64']:.2f}x (1.4x at B=64 ctx 4,096)")
    return result


def _server(ctx: Context, name: str, extra: list[str], timeout: float):
    """Starts `jaxserve serve` on the step section's shape; returns (process, base URL)."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = [f"--{name.replace('_', '-')}={value}" for name, value in STEP_SETTINGS[ctx.smoke].items()]
    command = [sys.executable, "-m", "jaxserve.cli", "serve", str(ctx.model_dir(ctx.shape("smollm2-1.7b"))),
               "--load-format", "dummy", "--port", str(port), *settings, *extra]
    log_file = open(ctx.workdir / f"{name}-server.log", "w")
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): "
                               f"{(ctx.workdir / f'{name}-server.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s")


def _bench(ctx: Context, url: str, label: str, flags: list[str]) -> dict:
    out = ctx.workdir / f"bench-{label}.json"
    command = [sys.executable, "-m", "jaxserve.cli", "bench", "serve", "--base-url", url, "--tokenizer",
               str(ctx.tokenizer), "--no-progress", "--label", label, "--out", str(out), *flags]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}  # the client needs no GPU
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    print(done.stdout[-3000:], done.stderr[-2000:], flush=True)
    if done.returncode:
        raise RuntimeError(f"bench serve {label} failed ({done.returncode}): {done.stderr[-1000:]}")
    run = json.loads(out.read_text())["runs"][0]
    keep = ("completed", "failed", "output_throughput", "total_token_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "duration_s", "first_error")
    return {k: run[k] for k in keep if k in run} | {k: v for k, v in run.items() if k.startswith("spec_")}


def _metric(url: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _stop(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(process.pid, signal.SIGKILL)


def section_server(ctx: Context) -> dict:
    def n(full, smoke):
        return str(smoke if ctx.smoke else full)

    process, url = _server(ctx, "server", [], timeout=240)
    try:
        random = ["--dataset-name", "random", "--input-len", n(256, 16), "--output-len", n(128, 8), "--ignore-eos"]
        result = {"c64": _bench(ctx, url, "c64", [*random, "--num-prompts", n(256, 8), "--max-concurrency", n(64, 4),
                                                  "--num-warmups", n(8, 1)])}
        log(f"concurrency 64: {result['c64']['output_throughput']:.0f} output tok/s")
        for ratio in ("0", "0.5"):
            result[f"c32_json_{ratio}"] = _bench(ctx, url, f"c32-json-{ratio}", [
                *random, "--num-prompts", n(64, 4), "--max-concurrency", n(32, 2), "--structured-output-ratio", ratio])
        result["grounded_c1"] = _bench(ctx, url, "grounded-c1", [
            "--dataset-name", "grounded", "--num-prompts", n(8, 2), "--output-len", n(128, 8),
            "--max-concurrency", "1"])
        result["compilations_since_warmup"] = _metric(url, "jaxserve:compilations_since_warmup")
        log(f"compilations after warm-up: {result['compilations_since_warmup']}")
    finally:
        _stop(process)
    return result


def section_ngram(ctx: Context) -> dict:
    def n(full, smoke):
        return str(smoke if ctx.smoke else full)

    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    process, url = _server(ctx, "ngram", ["--speculative-config", spec], timeout=240)
    try:
        result = {"grounded_c1": _bench(ctx, url, "ngram-grounded-c1", [
            "--dataset-name", "grounded", "--num-prompts", n(8, 2), "--output-len", n(128, 8),
            "--max-concurrency", "1"])}
        result["compilations_since_warmup"] = _metric(url, "jaxserve:compilations_since_warmup")
    finally:
        _stop(process)
    return result


def section_pytest(ctx: Context) -> dict:
    """The tests, one line each (-v), stopped 15 s inside the section's box so that what ran is reported
    (the box kills the section's process, and with it pytest's captured output)."""
    files = ["tests/test_pallas_attention.py", "tests/test_pallas_engine.py", "tests/test_sampling.py"]
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu or not slow", *files]
    if ctx.smoke:  # on a CPU these would interpret the kernels for minutes: check the command collects
        command.append("--collect-only")
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=max(ctx.box - 15, 10))
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:  # killed; what it printed until then
        returncode = None
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                         for part in (e.stdout, e.stderr))
    lines = output.strip().splitlines()
    counts = {outcome: sum(1 for line in lines if f" {outcome}" in line and "::" in line)
              for outcome in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    tail = lines[-40:]
    print("\n".join(tail), flush=True)
    summary = tail[-1] if tail and returncode is not None else f"stopped at the box: {counts}"
    return {"returncode": returncode, "summary": summary, "counts": counts, "tail": tail,
            "failed": [line for line in lines if " FAILED" in line or " ERROR" in line][:40], "collect_only": ctx.smoke}


# A smoke run on a busy 2-core CPU (CI runs two test files at once) is not an H100: its sections get this
# many times their H100 boxes, and the run's deadline still bounds the whole.
SMOKE_BOX_FACTOR = 4

SECTIONS = {  # name: (function, time box in seconds on an H100)
    "ceilings": (section_ceilings, 25),
    "kernels": (section_kernels, 45),
    "step": (section_step, 220),  # 182 s on the H200 (12d6c49), before the staged-inputs experiment
    "parity": (section_parity, 110),  # on the H200 (12d6c49) float32 alone took 57 s, and 70 s cut bfloat16 off
    "server": (section_server, 150),
    "pytest": (section_pytest, 120),  # before ngram: on random weights ngram drafts nothing (0 drafts, H200)
    "ngram": (section_ngram, 90),
    # the second call's: on the H200 (12d6c49) the first call's sections up to ngram took 498 s of its 570
    "quant": (section_quant, 200),
    "llama8b": (section_llama8b, 200),  # its engine took 170 s to start on the H200, 69 s of it warm-up
}


# The two device calls a lease holds: the second's engines on the 8B shape take minutes to start
PARTS = {"first": list(SECTIONS)[:list(SECTIONS).index("quant")], "second": ["quant", "llama8b"]}


# ----------------------------------------------------------------------------------------------
# The run: each section in its own process, under its time box and the run's deadline


def run_section(name: str, args: argparse.Namespace, timeout: float, log_file) -> dict:
    command = [sys.executable, __file__, "--section", name, "--workdir", args.workdir, "--section-box",
               f"{timeout:.0f}", "--tokenizer", args.tokenizer] + (["--smoke"] if args.smoke else [])
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, cwd=REPO)
    tail: list[str] = []

    def pump():
        for line in process.stdout:
            log_file.write(f"[{name}] {line}")
            print(f"  [{name}] {line}", end="", flush=True)
            tail.append(line)
            del tail[:-40]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout)
        error = None if process.returncode == 0 else f"exited with {process.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        error = f"ran out of its {timeout:.0f} s"
    reader.join(timeout=5)
    seconds = time.perf_counter() - start
    path = Path(args.workdir) / f"{name}.json"
    result = json.loads(path.read_text()) if path.exists() else None
    if error is None and result is not None:
        return {"seconds": seconds, "result": result}
    entry = {"seconds": seconds, "error": error or "wrote no result", "log_tail": "".join(tail[-20:])}
    return entry | ({"partial": result} if result is not None else {})


def machine(commit: str) -> dict:
    """The run's facts, read without starting JAX here: a process that touches the GPU takes most of
    its memory, and the sections need it."""
    from importlib.metadata import version

    facts = {"commit": commit, "date": datetime.date.today().isoformat(), "jax": version("jax"),
             "python": platform.python_version(), "jax_platforms": os.environ.get("JAX_PLATFORMS", "")}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        facts["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        facts["nvidia_smi"] = None
    return facts


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _ceilings_rows(c: dict) -> list:
    return [("ceilings", f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
                         f"{c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")]


def _kernels_rows(k: dict) -> list:
    rows = []
    for r in k["cases"]:
        figure = (f"{r['tflops']:.0f} TFLOP/s = {r['share_of_matmul']:.0%} of matmul" if "tflops" in r else
                  f"{r['share_of_copy_floor']:.0%} of the copy floor")
        rows.append((f"kernel {r['case']}", f"{r['pallas_ms']:.3f} ms ({figure}); XLA {r['xla_ms']:.2f} ms"))
    return rows


def _step_rows(s: dict) -> list:
    rows = []
    for r in s["steps"]:
        if "error" in r:
            rows.append((f"step B={r['batch']} ctx {r['context']}", r["error"]))
            continue
        rows.append((f"step B={r['batch']} ctx {r['context']} async {'on' if r['async_scheduling'] else 'off'}",
                     f"{r['step_ms']:.2f} ms, device {r['device_ms']:.2f}, busy {r['device_busy']:.0%}, host "
                     f"{r['host_ms']:.2f}, {r['step_over_floor']:.1f}x floor {r['floor_ms']:.2f}"))
    for r in s.get("staged_inputs", []):
        rows.append((f"step B={r['batch']} ctx {r['context']} inputs "
                     + ("numpy" if r["held"] is None else f"on the device, {r['held']} held"),
                     f"{r['step_ms']:.2f} ms, launch {r['phase_ms']['launch']:.2f} ms, device {r['device_ms']:.2f}"))
    if (profile := s.get("profile")) and profile.get("lines"):
        busiest = max(profile["lines"], key=lambda line: line["ms_per_step"])
        rows.append((f"profile B={profile['batch']} ctx {profile['context']}",
                     f"{busiest['line']}: {busiest['ms_per_step']:.2f} ms a step; "
                     + ", ".join(f"{name[:40]} {ms:.2f}" for name, ms in busiest["top"][:4])))
    if o := s.get("offline"):
        rows.append(("offline 1.7B shape", f"{o['output_tok_s']:.0f} output tok/s ({o['output_tokens']} tokens, "
                                           f"{o['seconds']:.1f} s); compiles after warm-up "
                                           f"{s['compilations_since_warmup']}"))
    return rows


def _parity_rows(p: dict) -> list:
    return [(f"parity {dtype}", f"{p[dtype]['equal_prompts']}/{p['num_prompts']} prompts equal, logprobs within "
                                f"{p[dtype]['max_logprob_diff_on_agreed_tokens']:.1e}")
            for dtype in ("float32", "bfloat16") if dtype in p]


def _llama8b_rows(e: dict) -> list:
    plan = (f"{e['num_pages']} pages ({e['kv_cache_bytes'] / 2**30:.1f} GiB) beside "
            f"{e['weight_bytes'] / 2**30:.1f} GiB of weights")
    steps = ", ".join(f"B={r['batch']} {r['step_ms']:.2f} ms" for r in e["steps"])
    ttft = f"; TTFT {min(e['ttft_ms']):.0f} ms" if "ttft_ms" in e else ""
    return [("8B shape, no flags", f"{plan}; {steps}{ttft}")]


def _server_rows(g: dict) -> list:
    c64 = g["c64"]
    return [("server c64", f"{c64['output_throughput']:.0f} out tok/s, TTFT p50 {_fmt(c64.get('median_ttft_ms'), '.0f')}"
                           f" ms, ITL p50 {_fmt(c64.get('median_itl_ms'))} ms; compiles {g.get('compilations_since_warmup')}"),
            ("server c32 JSON half / none", f"{g['c32_json_0.5']['output_throughput']:.0f} / "
                                            f"{g['c32_json_0']['output_throughput']:.0f} out tok/s"),
            ("server grounded c1", f"{g['grounded_c1']['output_throughput']:.0f} out tok/s")]


def _quant_rows(q: dict) -> list:
    rows = [(f"{q['shape']} {r['label']}", f"step {r['step_ms']:.2f} ms, device {r['device_ms']:.2f} ms"
             + (f"; GEMMs {r['gemms']}" if "gemms" in r else "")) for r in q["runs"]]
    if "fp8_weights_speedup_b1" in q:
        rows.append((f"{q['shape']} bf16 / 8-bit, device ms a step", f"fp8 weights B=1 {q['fp8_weights_speedup_b1']:.2f}x, "
                                                          f"fp8 KV at the long context {q['fp8_kv_speedup_b64']:.2f}x"))
    return rows


SUMMARIES = {"ceilings": _ceilings_rows, "kernels": _kernels_rows, "step": _step_rows, "parity": _parity_rows,
             "llama8b": _llama8b_rows, "server": _server_rows, "quant": _quant_rows,
             "ngram": lambda g: [("ngram grounded c1", f"{g['grounded_c1']['output_throughput']:.0f} out tok/s")],
             "pytest": lambda t: [("pytest", f"rc {t['returncode']}: {t['summary']}")]}


def summary_rows(sections: dict) -> list[tuple[str, str]]:
    """The short table: the figures the issue's acceptance names, each section's error, and what a
    section that was stopped had measured."""
    rows = []
    for name, entry in sections.items():
        if "error" in entry:
            rows.append((name, f"ERROR: {entry['error']}" + ("; what it measured:" if "partial" in entry else "")))
        result = entry.get("result", entry.get("partial"))
        if result is None:
            continue
        try:
            rows += SUMMARIES[name](result)
        except (KeyError, ValueError):  # a stopped section's results end where it stopped
            rows.append((name, "(incomplete)"))
    return rows


def write_results(out: Path, facts: dict, sections: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"machine": facts, "sections": sections}, indent=2, default=str))
    table = ["| what | result |", "|---|---|"] + [f"| {a} | {b} |" for a, b in summary_rows(sections)]
    device = (sections.get("ceilings", {}).get("result", {}).get("device")
              or (facts.get("nvidia_smi") or "?").split(",")[0])
    head = (f"# GPU run {facts['date']}, commit {facts['commit']}\n\n{device} "
            f"({facts.get('nvidia_smi') or 'no nvidia-smi'}), JAX {facts['jax']}, Python "
            f"{facts['python']}\n\nSections: " + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in sections.items())
            + "\n\n")
    text = head + "\n".join(table) + "\n"
    (out / "results.md").write_text(text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU: checks this script")
    parser.add_argument("--prepare", action="store_true", help="write the tokenizer the run needs, then exit")
    parser.add_argument("--commit", default="unknown", help="the commit being measured (the call has no .git)")
    parser.add_argument("--out", default=None, help="results folder (default $OUT, else benchmarks/results/gpu/latest)")
    parser.add_argument("--deadline-s", type=float, default=None, help="the whole run's limit (default 450; smoke 900)")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=None)
    parser.add_argument("--part", choices=list(PARTS), default=None,
                        help="first: the sections up to ngram (the first device call); second: the 8B shape's")
    parser.add_argument("--box-s", type=float, default=None,
                        help="every section's time box (default each one's own): a rerun of one section after a fix")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    parser.add_argument("--ceilings-from", default=None, metavar="RESULTS_JSON",
                        help="skip measuring the ceilings: take them from an earlier run's results.json (same card)")
    parser.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--section-box", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.section:  # one section, in its own process
        result = SECTIONS[args.section][0](Context(args))
        Path(args.workdir, f"{args.section}.json").write_text(json.dumps(result, indent=2, default=str))
        return 0
    tokenizer = Path(args.tokenizer)
    if args.prepare or (args.smoke and not tokenizer.exists()):
        from jaxserve.weights import load_tokenizer

        tokenizer.mkdir(parents=True, exist_ok=True)
        load_tokenizer(None).save_pretrained(tokenizer)
        log(f"wrote the default model's tokenizer to {tokenizer}")
        if args.prepare:
            return 0
    if not tokenizer.exists():
        raise SystemExit(f"no tokenizer at {tokenizer}: run `python benchmarks/gpu_run.py --prepare` first "
                         f"and carry {tokenizer.parent.name}/ with the call")
    out = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks/results/gpu/latest")
    deadline = args.deadline_s or (900 if args.smoke else 450)
    facts = machine(args.commit)
    log(f"GPU run of {facts['commit']} on {facts['nvidia_smi'] or 'no GPU'}, JAX {facts['jax']}; "
        f"deadline {deadline:.0f} s")
    sections: dict = {}
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-run-") as workdir, open(out / "log.txt", "w") as log_file:
        args.workdir = workdir
        if args.ceilings_from:
            earlier = json.loads(Path(args.ceilings_from).read_text())
            sections["ceilings"] = earlier["sections"]["ceilings"] | {"from": args.ceilings_from}
            Path(workdir, "ceilings.json").write_text(json.dumps(sections["ceilings"]["result"]))
        os.environ["JAXSERVE_COMPILATION_CACHE"] = str(Path(workdir) / "xla")  # shared by the sections
        for name in args.only or PARTS.get(args.part, list(SECTIONS)):
            remaining = deadline - (time.perf_counter() - START)
            if remaining < 20:
                sections[name] = {"seconds": 0.0, "error": f"not started: {remaining:.0f} s left of the deadline"}
                continue
            box = min(args.box_s or SECTIONS[name][1] * (SMOKE_BOX_FACTOR if args.smoke else 1), remaining)
            log(f"section {name} (time box {box:.0f} s)")
            sections[name] = run_section(name, args, box, log_file)
            log(f"section {name}: {sections[name].get('error') or 'done'} in {sections[name]['seconds']:.0f} s")
            write_results(out, facts, sections)  # after every section: a killed run still leaves its results
    text = write_results(out, facts, sections)
    print("\n" + text, flush=True)
    return 1 if any("error" in s for s in sections.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
