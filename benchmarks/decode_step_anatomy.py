"""Where a CPU decode step's time goes, kernel by kernel, beside the bytes each kernel reads.

    python benchmarks/decode_step_anatomy.py [--num-prompts 32] [--input-len 256] [--warm-steps 40]
                                             [--steps 20] [--out FILE] [engine flags, e.g. --max-num-seqs 32]

Queues --num-prompts random prompts of --input-len tokens at once (greedy, `ignore_eos`), steps the engine
until every prompt is in and --warm-steps decode steps more have run, then traces --steps decode steps with
JAX's profiler (asynchronous scheduling off, so each step runs alone). Each step's custom calls are taken in
their order in the compiled step: per layer the packed matmul of q, k and v, the page write, the attention,
o_proj, the gated MLP's gate and up, down_proj, and under bfloat16 matmuls the residual adds with the norms
after them (`add + norm`, before qkv and before gate_up); then the LM head and, where
the C++ kernels sample, the greedy token (`argmax`). Prints each one's median time a call and its share of
the step, the weights' and KV pages' bytes a step and the rate each kernel read them at, beside the rate
XLA's sum reads a 512 MiB array at here (profile_kernels.py's) and the step those two rates would
give. Needs the C++ matmul and attention on every layer (a CPU's defaults, `cpu-bf16` or `--quantization`);
for other backends the custom calls do not follow that order and the script stops saying so.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_kernels import measure_read_bandwidth  # noqa: E402

LAYER_CALLS = ("qkv", "write pages", "attention", "o_proj", "gate_up", "down_proj")
NORM = "add + norm"  # cpu_ffi.add_rms_norm, under bfloat16 matmuls: before qkv and before gate_up


def layer_call_names(num_layers: int, fused_norms: bool) -> list[str]:
    """The model's custom calls of one step in order, the LM head last."""
    names = []
    for _ in range(num_layers):
        names += [NORM] * fused_norms + ["qkv", "write pages", "attention", "o_proj"]
        names += [NORM] * fused_norms + ["gate_up", "down_proj"]
    return names + ["lm_head"]


def step_calls(trace_file: Path, num_layers: int) -> tuple[list[float], dict[str, list[float]]]:
    """Each traced step's span (ms) and, per custom call of LAYER_CALLS (and the fused residual adds and
    norms where the step makes them) + the LM head (+ the sampler's argmax), its times (us)."""
    events = json.load(gzip.open(trace_file))["traceEvents"]
    steps: dict[str, list[dict]] = collections.OrderedDict()
    for event in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        args = event.get("args", {})
        if "batch_step" in args.get("hlo_module", ""):
            steps.setdefault(args["run_id"], []).append(event)
    spans, calls = [], collections.defaultdict(list)
    layouts = [layer_call_names(num_layers, fused) for fused in (False, True)]
    for ops in steps.values():
        custom = [e for e in ops if e["name"].startswith("ffi_call")]
        names = next((n for n in layouts if len(custom) in (len(n), len(n) + 1)), None)
        if names is None:
            raise SystemExit(f"a step made {len(custom)} custom calls, not {len(LAYER_CALLS)} a layer (and the fused "
                             "adds and norms), the LM head and the sampler's: this script needs the C++ matmul and "
                             "attention on every layer")
        spans.append((ops[-1]["ts"] + ops[-1]["dur"] - ops[0]["ts"]) / 1e3)
        for name, event in zip(names, custom):
            calls[name].append(event["dur"])
        if len(custom) > len(names):  # the greedy token (sampling.cpu_argmax)
            calls["argmax"].append(custom[len(names)]["dur"])
    return spans, calls


def decode_budget(max_model_len: int, input_len: int, warm_steps: int, steps: int) -> int:
    """max_tokens of the traced requests: as many as the model length leaves, since the prompts are admitted a
    chunk at a time and the first ones decode while the last are prefilled (32 prompts of 1,024 tokens: about
    64 steps before the last one is in), so that none finishes before the traced steps end."""
    budget = max_model_len - input_len
    if budget < warm_steps + steps + 1:
        raise SystemExit(f"max_model_len {max_model_len} leaves {budget} tokens after a prompt of {input_len}: "
                         f"fewer than --warm-steps {warm_steps} + --steps {steps} + 1")
    return budget


def main(argv: list[str] | None = None) -> dict:
    from jaxserve.config.engine_config import add_engine_flags, engine_config_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--warm-steps", type=int, default=40, help="decode steps before the traced ones")
    parser.add_argument("--steps", type=int, default=20, help="decode steps traced")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from jaxserve.config.sampling_params import SamplingParams
    from jaxserve.llm import LLM
    from jaxserve.ops.cpu_ffi import cpu_features

    config = dataclasses.asdict(engine_config_from_args(args)) | {"async_scheduling": False}
    llm = LLM(args.model, **config)
    engine, model = llm.engine, llm.engine.model_cfg
    rng = np.random.default_rng(args.seed or 0)
    llm.generate([{"prompt_token_ids": [100] * 8}], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    max_tokens = decode_budget(engine.cfg.max_model_len, args.input_len, args.warm_steps, args.steps)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(rng.integers(100, model.vocab_size - 100, args.input_len).tolist(), params)
                for _ in range(args.num_prompts)]
    while any(r.num_computed_tokens < args.input_len for r in requests):
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    if any(r.status.is_finished for r in requests):
        raise SystemExit(f"a request reached max_model_len before the traced steps (prompts of {args.input_len} "
                         f"tokens, {max_tokens} tokens after them: lower --input-len or --warm-steps)")
    if len(engine.last_schedule.scheduled) != args.num_prompts:
        raise SystemExit("the engine did not hold every prompt in its decode steps (raise --max-num-seqs or the "
                         "KV cache, or lower --num-prompts)")
    context = statistics.mean(r.num_tokens for r in requests) + args.steps / 2  # the traced steps' middle
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = (time.perf_counter() - start) / args.steps
        jax.profiler.stop_trace()
        spans, calls = step_calls(next(Path(tmp).rglob("*.trace.json.gz")), model.num_layers)

    kv_item = jax.tree_util.tree_leaves(engine.runner.kv_cache)[0].dtype.itemsize  # the pages' element
    kv_bytes = args.num_prompts * context * 2 * model.num_kv_heads * model.head_dim * kv_item * model.num_layers
    weight_bytes = engine.runner.device_weight_bytes
    step_ms = statistics.median(spans)
    per_step = {name: sum(times) / args.steps / 1e3 for name, times in calls.items()}  # ms
    matmul_ms = sum(per_step[name] for name in ("qkv", "o_proj", "gate_up", "down_proj", "lm_head"))
    bandwidth = measure_read_bandwidth()
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                     if f in cpu_features().split())
    print(f"\nCPU flags: {flags}; {args.num_prompts} rows at context {context:.0f}; a step {step_ms:.2f} ms in the "
          f"trace ({wall * 1e3:.2f} ms by the wall clock, median of {args.steps})\n")
    print("| call | median a call | a step | share |\n|---|---|---|---|")
    for name, times in calls.items():
        print(f"| {name} | {statistics.median(times):.1f} us | {per_step[name]:.2f} ms | "
              f"{per_step[name] / step_ms:.1%} |")
    rest = step_ms - sum(per_step.values())
    print(f"| the rest (XLA's fusions, sampling) | | {rest:.2f} ms | {rest / step_ms:.1%} |\n")
    print(f"weights {weight_bytes / 1e6:.0f} MB a step, read by the matmuls at "
          f"{weight_bytes / matmul_ms / 1e6:.1f} GB/s; KV pages {kv_bytes / 1e6:.0f} MB, read by the attention at "
          f"{kv_bytes / per_step['attention'] / 1e6:.1f} GB/s; XLA's sum over 512 MiB here: {bandwidth / 1e9:.1f} GB/s")
    floor = (weight_bytes + kv_bytes) / bandwidth * 1e3
    print(f"both at that rate and the rest as it was: a step of {floor + per_step['write pages'] + rest:.2f} ms "
          f"against {step_ms:.2f}")
    result = {"cpu_flags": flags, "rows": args.num_prompts, "context": context, "step_ms": step_ms,
              "wall_step_ms": wall * 1e3, "per_step_ms": per_step, "rest_ms": rest,
              "median_call_us": {name: statistics.median(times) for name, times in calls.items()},
              "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "read_bandwidth_gb_s": bandwidth / 1e9,
              "step_ms_at_read_bandwidth": floor + per_step["write pages"] + rest}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
