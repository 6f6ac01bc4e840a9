"""Step throughput of jaxserve's model runner beside Hugging Face transformers, same machine, same run.

Measures, for the default model (SmolLM2-135M-Instruct, float32) at several batch sizes B:

  prefill  one step over B random prompts of P tokens each (nothing cached) -> B*P / seconds
  decode   N steps of one token per sequence, the cache growing from P    -> B*N / seconds

jaxserve side: `ModelRunner.execute` + `fetch` directly (no scheduler, no engine), after `warmup()`
compiled every bucket; the compile time is reported on its own. Each step includes building the
step's numpy inputs, the device call, on-device greedy sampling and the host copy of the sampled
ids, so it is what the engine loop pays per step.
HF side: the same GGUF loaded by transformers in float32; prefill is one forward over [B, P] with
use_cache, decode is a manual greedy loop over `past_key_values` (timed without its prefill). With
--hf-generate, `generate(max_new_tokens=N)` minus the prefill time is a second decode figure.

Then, unless --skip-phases, the engine's own loop (`LLMEngine.step`: schedule, build inputs, launch,
wait for the tokens, update and detokenize) at each of --phase-batch-sizes (1, 32, 128 by default,
where the KV pool holds them), with asynchronous scheduling off and on: B requests of P prompt tokens
and N greedy tokens; per decode step, the host's time in each phase (`LLMEngine.phase_seconds`), the
step's wall time, and the time the device is busy with one such step (the executable most of those
steps ran, run back to back on its last inputs, --repeats x 8 times, divided). "wait" is the device time the host could
not hide; with asynchronous scheduling the host's other phases overlap the device's step.

Every figure is the median of --repeats timed rounds after one untimed round. Within a round the
two sides alternate (jaxserve prefill, HF prefill, jaxserve decode, HF decode), so load from other
users of a shared machine lands on both sides alike; the load average is recorded. On 2 cores that
other processes also use, torch's default of 2 threads can be several times slower than 1
(`--torch-threads 1`); compare like with like.

    python benchmarks/bench_steps.py [--batch-sizes 1 8 32] [--prompt-len 128] [--decode-steps 32]
                                     [--repeats 3] [--skip-hf] [--hf-generate] [--torch-threads T]
                                     [--phase-batch-sizes 1 32 128] [--skip-phases] [--out results.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

START = time.perf_counter()

# name -> (timed function, untimed setup run before each call or None)
Cases = dict[str, tuple[Callable[[], None], Callable[[], None] | None]]


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.0f}s] {message}", flush=True)


# ----------------------------------------------------------------------------------------------
# jaxserve


def engine_phases(engine, prompts: np.ndarray, decode_steps: int, async_scheduling: bool,
                  device_repeats: int) -> dict:
    """The engine's loop over B requests (prompts [B, P]), decode steps only: per step, ms in each
    phase, the step's wall ms, and the device's ms for one step (see the module docstring).

    The prompts may take several steps (max_num_batched_tokens), and the first ones start decoding while
    the others are still prompts: so every request may generate until all B have their first token, then
    exactly `decode_steps` steps are timed, each with all B decoding, and the requests are aborted."""
    from jaxserve.core.engine import STEP_PHASES
    from jaxserve.config.sampling_params import SamplingParams

    runner = engine.runner
    engine.async_scheduling = async_scheduling
    # every step's budget less the rows already decoding: up to len(prompts) of them (at B=128, 2,000-token
    # prompts and 2,048 tokens a step, the full budget counted 127 steps where 134 ran, and the first
    # request reached max_tokens inside the timed steps on an H200)
    budget = max(engine.cfg.max_num_batched_tokens - len(prompts), 1)
    prompt_steps = -(-prompts.size // budget) + 2
    params = SamplingParams(temperature=0.0, max_tokens=prompt_steps + decode_steps + 2, ignore_eos=True)
    requests = [engine.add_request(p.tolist(), params) for p in prompts]
    while not all(r.output_token_ids for r in requests):  # the prompts, and their first tokens read
        engine.step()
    seen: dict[tuple[str, int], list] = {}  # per executable: how many steps ran it, and its last inputs
    launch = runner.launch

    def recording_launch(kind, bucket, inputs):
        seen.setdefault((kind, bucket), [0, None])[0] += 1
        seen[kind, bucket][1] = inputs
        return launch(kind, bucket, inputs)

    runner.launch = recording_launch
    phases, steps, start = dict(engine.phase_seconds), engine.num_steps, time.perf_counter()
    try:
        for _ in range(decode_steps):
            engine.step()
    finally:
        del runner.launch
    wall, steps = time.perf_counter() - start, engine.num_steps - steps
    assert steps > 0 and not any(r.status.is_finished for r in requests), "a request ended inside the timed steps"
    for request in requests:
        engine.abort_request(request.request_id)
    while engine.has_unfinished:
        engine.step()
    # The device's time for one step of the executable most of these steps ran, alone: back to back,
    # waited for once. (Its inputs' K/V rewrite freed pages: callers drop the prefix cache after, so
    # nothing reads them; row updates are left out, as most steps have none.)
    (kind, bucket), (_, inputs) = max(seen.items(), key=lambda item: item[1][0])
    inputs = inputs._replace(prev_rows=np.full_like(inputs.prev_rows, -1),
                             **{name: None for name in ("row_updates",) if name in inputs._fields})
    runner.fetch(runner.launch(kind, bucket, inputs), 1, False)
    device_start = time.perf_counter()
    for _ in range(device_repeats):
        out = runner.launch(kind, bucket, inputs)
    runner.fetch(out, 1, False)
    device = (time.perf_counter() - device_start) / device_repeats
    per_step = {phase: 1000 * (engine.phase_seconds[phase] - phases[phase]) / steps for phase in STEP_PHASES}
    return {"async_scheduling": async_scheduling, "decode_steps": steps, "phase_ms": per_step,
            "host_ms": sum(v for k, v in per_step.items() if k != "wait"), "step_ms": 1000 * wall / steps,
            "device_ms": 1000 * device, "device_busy": min(device / (wall / steps), 1.0),
            "bucket": f"{kind} {bucket}", "buckets_run": {f"{k} {b}": n for (k, b), (n, _) in seen.items()}}


class JaxserveBench:
    def __init__(self, max_batch: int, prompt_len: int, decode_steps: int, max_phase_batch: int = 0,
                 **settings):
        """settings: engine settings besides float32 and the batch limits (benchmarks/bench_quantization.py)."""
        from jaxserve.core.engine import LLMEngine
        from jaxserve.config.engine_config import EngineConfig
        from jaxserve.weights import load_model

        start = time.perf_counter()
        loaded = load_model(None, "float32")
        self.load_seconds = time.perf_counter() - start
        self.vocab_size = loaded.config.vocab_size
        # Engine defaults except the two limits the largest batch needs: all B prompts in one step.
        self.cfg = EngineConfig(
            dtype="float32",
            max_num_seqs=max(32, max_batch, max_phase_batch),
            max_num_batched_tokens=max(512, max_batch * prompt_len),
            **settings,
        )
        # The runner-level cases below use the engine's runner and pool directly, between its own runs.
        self.engine = LLMEngine(loaded, self.cfg)
        self.runner, self.pool, self.cfg = self.engine.runner, self.engine.pool, self.engine.cfg
        self.prompt_len, self.decode_steps = prompt_len, decode_steps
        needed = max_batch * self.pool.pages_needed([], prompt_len + decode_steps)
        if needed > self.pool.num_free_pages:
            raise SystemExit(f"the KV pool has {self.pool.num_free_pages} pages; this run needs {needed}")
        self.tables: list[list[int]] = []
        self.first_tokens: np.ndarray | None = None

    def warmup(self) -> dict:
        return self.engine.warmup(show_progress=True)

    def free_tables(self) -> None:
        for table in self.tables:
            self.pool.free(table)
        self.tables = []

    def phases(self, prompts: np.ndarray, async_scheduling: bool, device_repeats: int) -> dict:
        result = engine_phases(self.engine, prompts, self.decode_steps, async_scheduling, device_repeats)
        self.pool.reset_prefix_cache()
        return result

    def cases(self, prompts: np.ndarray) -> Cases:
        """prompts [B, P] int32. Prefill must run before decode (decode feeds on its sampled ids)."""
        from jaxserve.runner.step_inputs import ScheduledSeq
        from jaxserve.config.sampling_params import SamplingParams

        greedy = SamplingParams(temperature=0.0)
        self.free_tables()
        batch, prompt_len = prompts.shape
        self.tables = [[] for _ in range(batch)]
        for table in self.tables:  # every page the prompt and its decode steps will touch, up front
            assert self.pool.grow(table, prompt_len + self.decode_steps)

        def seq(tokens: list[int], num_computed: int, req_index: int) -> ScheduledSeq:
            # Sequence i in row i of the device batch; its row is written by the prefill (its pages are all
            # there from the start), as the engine writes a row only when it changes
            return ScheduledSeq(tokens, num_computed, self.tables[req_index], params=greedy, seed=0,
                                req_index=req_index, write_row=num_computed == 0, write_history=num_computed == 0)

        def step(seqs: list[ScheduledSeq]) -> np.ndarray:  # what the engine loop does per step
            return self.runner.fetch(self.runner.execute(seqs), len(seqs), with_logprobs=False).token_ids

        prefill_seqs = [seq(p.tolist(), 0, i) for i, p in enumerate(prompts)]

        def prefill():
            self.first_tokens = step(prefill_seqs)

        def decode():  # rewrites positions P.. of the same pages on every run, as a real decode would
            last = self.first_tokens
            for i in range(self.decode_steps):
                last = step([seq([int(tok)], prompt_len + i, row) for row, tok in enumerate(last)])

        return {"prefill": (prefill, None), "decode": (decode, None)}


# ----------------------------------------------------------------------------------------------
# Hugging Face transformers


class HFBench:
    def __init__(self, decode_steps: int, with_generate: bool, num_threads: int | None):
        import torch
        from transformers import AutoModelForCausalLM

        from jaxserve.weights import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE

        self.torch = torch
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.with_generate = with_generate
        model_dir = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE).submodule_search_locations[0]
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=DEFAULT_MODEL_FILE,
                                                          dtype=torch.float32).eval()
        self.load_seconds = time.perf_counter() - start
        self.decode_steps = decode_steps
        self.first_tokens: list[int] | None = None

    def cases(self, prompts: np.ndarray) -> Cases:
        torch = self.torch
        ids = torch.from_numpy(prompts.astype(np.int64))  # [B, P]
        attention_mask = torch.ones_like(ids)
        state = {}

        @torch.inference_mode()
        def prefill():
            out = self.model(input_ids=ids, use_cache=True)
            state["cache"], state["next"] = out.past_key_values, out.logits[:, -1].argmax(-1)
            self.first_tokens = state["next"].tolist()

        @torch.inference_mode()
        def decode():  # greedy, one token per sequence per step, over the prefill's cache
            cache, last = state["cache"], state["next"]
            for _ in range(self.decode_steps):
                out = self.model(input_ids=last[:, None], past_key_values=cache, use_cache=True)
                cache, last = out.past_key_values, out.logits[:, -1].argmax(-1)

        @torch.inference_mode()
        def generate():
            self.model.generate(ids, attention_mask=attention_mask, max_new_tokens=self.decode_steps,
                                min_new_tokens=self.decode_steps, do_sample=False, pad_token_id=0)

        def trim_cache():  # the cache grows in place: cut it back to the prompt before each decode run
            cache = state["cache"]
            if (excess := cache.get_seq_length() - prompts.shape[1]) > 0:
                cache.crop(-excess)  # a negative count removes that many tokens, in transformers 4.x and 5.x

        cases = {"prefill": (prefill, None), "decode": (decode, trim_cache)}
        if self.with_generate:
            cases["generate"] = (generate, None)
        return cases


# ----------------------------------------------------------------------------------------------


def run_rounds(sides: dict[str, Cases], repeats: int, label: str) -> dict[str, dict[str, list[float]]]:
    """One untimed round, then `repeats` timed ones; each round runs every case once, interleaved."""
    order = [(side, case) for case in ("prefill", "decode", "generate") for side in sides if case in sides[side]]
    times = {side: {case: [] for case in cases} for side, cases in sides.items()}
    for round_ in range(repeats + 1):
        took = []
        for side, case in order:
            fn, setup = sides[side][case]
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            took.append(f"{side} {case} {elapsed:.2f}s")
            if round_:
                times[side][case].append(elapsed)
        log(f"{label}: round {round_ + 1}/{repeats + 1}{' (untimed)' if not round_ else ''}: {', '.join(took)}; "
            f"load average {os.getloadavg()[0]:.1f}")
    return times


def summarize(times: dict[str, list[float]], batch: int, prompt_len: int, steps: int) -> dict:
    out = {f"{case}_s": ts for case, ts in times.items()}
    prefill_s, decode_s = statistics.median(times["prefill"]), statistics.median(times["decode"])
    out |= {
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_tok_s": batch * steps / decode_s,
        "decode_step_ms": 1000 * decode_s / steps,
    }
    if "generate" in times:
        # generate() = its own prefill + N-1 decode forwards; the brief's B*N / (t_generate - t_prefill),
        # None when noise makes generate() look no slower than a prefill.
        generate_s = statistics.median(times["generate"])
        out["generate_decode_tok_s"] = batch * steps / (generate_s - prefill_s) if generate_s > prefill_s else None
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def table(results: list[dict]) -> str:
    with_generate = any("generate_decode_tok_s" in (r.get("hf") or {}) for r in results)
    header = ("| batch | jaxserve prefill tok/s | HF prefill tok/s | prefill jax/HF | jaxserve decode tok/s "
              "| HF decode tok/s | decode jax/HF |")
    lines = [header + (" HF generate() decode tok/s |" if with_generate else ""),
             "|---:" * (8 if with_generate else 7) + "|"]
    for r in results:
        jx, hf = r["jaxserve"], r.get("hf") or {}
        jp, jd = jx["prefill_tok_s"], jx["decode_tok_s"]
        hp, hd = hf.get("prefill_tok_s"), hf.get("decode_tok_s")
        line = f"| {r['batch']} | {fmt(jp)} | {fmt(hp)} | {ratio(jp, hp)} | {fmt(jd)} | {fmt(hd)} | {ratio(jd, hd)} |"
        lines.append(line + (f" {fmt(hf.get('generate_decode_tok_s'))} |" if with_generate else ""))
    return "\n".join(lines)


def phase_table(results: list[dict]) -> str:
    from jaxserve.core.engine import STEP_PHASES

    lines = ["| batch | async | " + " | ".join(STEP_PHASES) + " | host (no wait) | step wall | device | busy |",
             "|---:|:---|" + "---:|" * (len(STEP_PHASES) + 4)]
    for r in results:
        phases = " | ".join(f"{r['phase_ms'][p]:.2f}" for p in STEP_PHASES)
        lines.append(f"| {r['batch']} | {'on' if r['async_scheduling'] else 'off'} | {phases} | {r['host_ms']:.2f} | "
                     f"{r['step_ms']:.2f} | {r['device_ms']:.2f} | {100 * r['device_busy']:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after one untimed round; median")
    parser.add_argument("--skip-hf", action="store_true", help="measure jaxserve only")
    parser.add_argument("--hf-generate", action="store_true",
                        help="also time HF generate() (decode = its time minus a prefill); slow at batch 32")
    parser.add_argument("--torch-threads", type=int,
                        help="torch.set_num_threads for HF (default: torch's own default, one per core)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--phase-batch-sizes", type=int, nargs="+", default=[1, 32, 128],
                        help="batch sizes of the engine-loop phase runs (those the KV pool cannot hold are skipped)")
    parser.add_argument("--skip-phases", action="store_true", help="skip the engine-loop phase runs")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("prompt_len", "decode_steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must be positive")
    load_start = os.getloadavg()

    import jax

    log(f"loading the jaxserve model (jax {jax.__version__}, {jax.devices()[0].platform}); "
        f"load average {load_start[0]:.1f}")
    phase_batches = [] if args.skip_phases else args.phase_batch_sizes
    jx = JaxserveBench(max(args.batch_sizes), args.prompt_len, args.decode_steps, max(phase_batches, default=0))
    log(f"loaded in {jx.load_seconds:.1f} s; compiling every bucket (max_num_batched_tokens="
        f"{jx.cfg.max_num_batched_tokens}, max_num_seqs={jx.cfg.max_num_seqs})")
    warmup = jx.warmup()
    log(f"compiled {warmup['num_executables']} executables in {warmup['seconds']:.1f} s")

    hf = None
    if not args.skip_hf:
        log("loading the HF transformers model")
        hf = HFBench(args.decode_steps, args.hf_generate, args.torch_threads)
        log(f"loaded in {hf.load_seconds:.1f} s (torch {hf.torch.__version__}, "
            f"{hf.torch.get_num_threads()} threads)")

    # Random ids above the special tokens; batch B takes the first B rows, on both sides.
    rng = np.random.default_rng(args.seed)
    all_prompts = rng.integers(100, jx.vocab_size, (max(args.batch_sizes), args.prompt_len), dtype=np.int32)
    results = []
    for batch in args.batch_sizes:
        prompts = all_prompts[:batch]
        sides = {"jaxserve": jx.cases(prompts)}
        if hf is not None:
            sides["hf"] = hf.cases(prompts)
        log(f"B={batch}: prefill {batch}x{args.prompt_len} tokens, {args.decode_steps} decode steps")
        times = run_rounds(sides, args.repeats, f"B={batch}")
        entry = {"batch": batch, "load_average": os.getloadavg()[0]}
        for side in sides:
            entry[side] = summarize(times[side], batch, args.prompt_len, args.decode_steps)
        message = (f"B={batch}: jaxserve prefill {entry['jaxserve']['prefill_tok_s']:,.0f} tok/s, decode "
                   f"{entry['jaxserve']['decode_tok_s']:,.0f} tok/s ({entry['jaxserve']['decode_step_ms']:.1f} ms/step)")
        if hf is not None:
            # Same weights, same prompts, greedy: the first sampled tokens should agree.
            same = sum(a == b for a, b in zip(jx.first_tokens.tolist(), hf.first_tokens))
            entry["first_token_agreement"] = f"{same}/{batch}"
            message += (f"; HF prefill {entry['hf']['prefill_tok_s']:,.0f} tok/s, decode "
                        f"{entry['hf']['decode_tok_s']:,.0f} tok/s ({entry['hf']['decode_step_ms']:.1f} ms/step); "
                        f"greedy first tokens agree {same}/{batch}")
        log(message)
        results.append(entry)

    jx.free_tables()
    phase_results = []
    for batch in phase_batches:
        needed = batch * jx.pool.pages_needed([], args.prompt_len + args.decode_steps)
        if needed > jx.pool.num_free_pages:
            log(f"phases B={batch}: skipped, the KV pool has {jx.pool.num_free_pages} pages and it needs {needed}")
            continue
        prompts = rng.integers(100, jx.vocab_size, (batch, args.prompt_len), dtype=np.int32)
        for async_scheduling in (False, True):
            runs = [jx.phases(prompts, async_scheduling, 8 * args.repeats) for _ in range(args.repeats)]
            entry = min(runs, key=lambda r: r["step_ms"]) | {"batch": batch}  # the least disturbed run
            log(f"phases B={batch} async_scheduling={async_scheduling}: step {entry['step_ms']:.2f} ms, host "
                f"{entry['host_ms']:.2f} ms, device {entry['device_ms']:.2f} ms ({100 * entry['device_busy']:.0f}% busy)")
            phase_results.append(entry)

    wall = time.perf_counter() - START
    load_end = os.getloadavg()
    print()
    print(f"SmolLM2-135M-Instruct float32, prompt {args.prompt_len} tokens, {args.decode_steps} decode steps, "
          f"median of {args.repeats} rounds; {os.cpu_count()} CPUs ({platform.machine()}), "
          f"load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end")
    print(f"jaxserve compile (warmup, {warmup['num_executables']} executables): {warmup['seconds']:.1f} s, "
          "not in the timings")
    print()
    print(table(results))
    if phase_results:
        print()
        print(f"engine decode steps: host ms per step by phase, the step's wall ms and the device's ms "
              f"(prompt {args.prompt_len}, {args.decode_steps} tokens; best of {args.repeats} runs)")
        print()
        print(phase_table(phase_results))
    print()
    print(f"wall time: {wall:.0f} s")

    report = {
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (dequantized, float32)",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "engine_config": {k: getattr(jx.cfg, k) for k in jx.cfg.__dataclass_fields__},
        "num_kv_pages": jx.runner.num_pages,
        "warmup": warmup,
        "load_seconds": {"jaxserve": jx.load_seconds, "hf": hf.load_seconds if hf else None},
        "environment": {
            "python": sys.version.split()[0], "jax": jax.__version__, "cpu_count": os.cpu_count(),
            "torch": hf.torch.__version__ if hf else None,
            "torch_threads": hf.torch.get_num_threads() if hf else None,
            "load_average_start": load_start, "load_average_end": load_end,
        },
        "results": results,
        "phases": phase_results,
        "wall_seconds": wall,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
