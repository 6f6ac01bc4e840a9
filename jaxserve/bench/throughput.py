"""`jaxserve bench throughput`: offline `LLM.generate` throughput on the benchmark datasets.

The same prompts as `jaxserve bench serve` (random, grounded or JSONL), run in-process with no HTTP, all
submitted at once; warm-up compiles are outside the timed region. Prints requests/s, output and
total tokens/s, and how close the run came to the device's peak (hardware.py). With
`--hf-baseline --ignore-eos`, Hugging Face transformers' batched `generate` runs the same prompts
afterwards (`hf_baseline.py`) and a second table puts the two side by side. `--out` writes the
results and the command line's arguments as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from jaxserve.bench.datasets import add_dataset_flags, requests_from_flags
from jaxserve.bench.metrics import format_spec_decode, spec_decode_summary
from jaxserve.config.engine_config import engine_config_from_args


def run(args: argparse.Namespace) -> dict:
    from jaxserve.bench.hardware import utilization_lines
    from jaxserve.llm import LLM
    from jaxserve.config.sampling_params import SamplingParams

    if args.hf_baseline and not args.ignore_eos:
        # HF's static batches generate every request's full length: jaxserve must too, or the ratio lies.
        raise ValueError("--hf-baseline needs --ignore-eos, so both engines generate the same number of tokens")
    llm = LLM(args.model, **dataclasses.asdict(engine_config_from_args(args)))
    engine_cfg = llm.engine.cfg  # with the settings left unset chosen for the device
    requests = requests_from_flags(args, llm.tokenizer, args.num_prompts)
    prompts = [{"prompt": r.prompt, "add_special_tokens": False} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=args.ignore_eos) for r in requests]
    steps_before = llm.engine.num_steps
    spec_before = llm.get_stats().get("spec_decode")  # None: speculation off
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    seconds = time.perf_counter() - start
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_steps = llm.engine.num_steps - steps_before
    stats = llm.get_stats()
    result = {"args": {k: v for k, v in vars(args).items() if k != "func"},
              "attention_backend": llm.engine.runner.attention_backend,
              "matmul_backend": llm.engine.runner.matmul_backend,
              "num_prompts": len(requests), "seconds": seconds, "num_steps": num_steps,
              "total_input_tokens": num_in, "total_output_tokens": num_out,
              "request_throughput": len(requests) / seconds, "output_throughput": num_out / seconds,
              "total_token_throughput": (num_in + num_out) / seconds,
              "stats": {k: v for k, v in stats.items() if k != "compiled_shapes"}}
    print(f"\n| offline throughput | |\n|---|---|\n| requests | {len(requests)} |\n"
          f"| seconds | {seconds:.1f} |\n| input / output tokens | {num_in} / {num_out} |\n"
          f"| requests/s | {result['request_throughput']:.2f} |\n"
          f"| output tokens/s | {result['output_throughput']:.1f} |\n"
          f"| total tokens/s | {result['total_token_throughput']:.1f} |\n")
    if spec_before and stats.get("spec_decode"):
        result["spec_decode"] = spec_decode_summary(spec_before, stats["spec_decode"])
        print("\n".join(["| speculative decoding | |", "|---|---|", *format_spec_decode(result["spec_decode"])]) + "\n")
    # the dtype the matmuls multiply in: the engine's, or bfloat16 under the cpu-bf16 kernels (float32 activations)
    multiply_dtype = "bfloat16" if llm.engine.runner.matmul_backend == "cpu-bf16" else engine_cfg.dtype
    result["utilization"] = utilization_lines(llm.engine.model_cfg, llm.engine.runner.params, multiply_dtype,
                                              num_in, num_out, num_steps, seconds)
    print("\n".join(result["utilization"]))
    if args.hf_baseline:
        from jaxserve.bench.hf_baseline import run_hf

        prompt_ids = [o.prompt_token_ids for o in outputs]
        del llm, outputs  # the engine's weights and KV pages are released before HF loads its own
        hf = result["hf_transformers"] = run_hf(prompt_ids, [r.output_len for r in requests], args.model,
                                                engine_cfg.dtype, args.hf_batch_size, not args.no_progress)
        hf_throughput = hf["total_output_tokens"] / hf["seconds"]
        print(f"\n| engine | seconds | output tokens/s |\n|---|---|---|\n"
              f"| jaxserve | {seconds:.1f} | {num_out / seconds:.1f} |\n"
              f"| HF transformers generate (batches of {hf['batch_size']}, {hf['device']}) | {hf['seconds']:.1f} | "
              f"{hf_throughput:.1f} |\n\njaxserve / HF output throughput: {num_out / seconds / hf_throughput:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


def add_flags(parser: argparse.ArgumentParser) -> None:
    add_dataset_flags(parser)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--hf-baseline", action="store_true",
                        help="then run HF transformers' batched generate on the same prompts and compare (needs torch "
                             "and --ignore-eos)")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="prompts per HF generate batch")
