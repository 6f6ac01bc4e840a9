"""Offline throughput: `LLM.generate` on N random prompts beside HF transformers' batched generate.

Both engines get the same prompts (random token ids, input lengths uniform in [min, max], a fixed
number of output tokens, EOS ignored) on the same machine in the same run. HF runs static batches
of --hf-batch-size prompts, left-padded, which is how a notebook user would batch it; on a GPU when
PyTorch sees one (CUDA), with its default (SDPA) attention. jaxserve also prints its model-FLOPs and
weight-bandwidth utilization (against the device's data sheet on a GPU).

    python benchmarks/bench_throughput.py --num-prompts 256 --input-len 32 512 --output-len 128
    python benchmarks/bench_throughput.py --model DIR --dtype bfloat16 --max-num-seqs 256  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def make_prompts(num_prompts: int, input_len: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]


def run_jaxserve(prompts, output_len: int, args) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.hardware import utilization_lines

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
              kv_cache_memory_bytes=int(args.kv_cache_memory_gib * 2**30))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    steps_before = llm.engine.num_steps
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    utilization = utilization_lines(llm.engine.model_cfg, llm.engine.runner.params, args.dtype,
                                    sum(map(len, prompts)), output_len * len(prompts),
                                    llm.engine.num_steps - steps_before, elapsed)
    print(f"jaxserve: {elapsed:.1f} s, {output_len * len(prompts) / elapsed:.1f} output tokens/s", *utilization,
          sep="\n", flush=True)
    return {"seconds": elapsed, "attention_backend": llm.engine.runner.attention_backend,
            "utilization": utilization,
            "stats": {k: v for k, v in llm.get_stats().items() if k != "compiled_shapes"}}


def run_hf(prompts, output_len: int, batch_size: int, model_dir: str | None, dtype: str) -> dict:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from jaxserve.weights import default_model_path

    torch_dtype = getattr(torch, dtype)
    if model_dir is None:
        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    pad = model.config.pad_token_id or 0
    with torch.no_grad():  # untimed warm-up, as jaxserve's compile is untimed too
        model.generate(input_ids=torch.tensor([prompts[0]], device=device), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad)
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="HF generate", unit="batch"):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        assert out.shape[1] == width + output_len
    return {"seconds": time.perf_counter() - start, "device": device, "batch_size": batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the default model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=0.5)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()

    from jaxserve.weights import load_hf_config

    vocab = 49152 if args.model is None else load_hf_config(args.model).vocab_size
    prompts = make_prompts(args.num_prompts, tuple(args.input_len), vocab, args.seed)
    num_in = sum(map(len, prompts))
    num_out = args.output_len * len(prompts)
    results = {"jaxserve": run_jaxserve(prompts, args.output_len, args)}  # its device memory is freed on return
    if not args.skip_hf:
        results["hf_transformers"] = run_hf(prompts, args.output_len, args.hf_batch_size, args.model, args.dtype)

    print(f"\n{len(prompts)} prompts, input {args.input_len[0]}..{args.input_len[1]} "
          f"(mean {statistics.mean(map(len, prompts)):.0f}), output {args.output_len}, {args.dtype}, greedy, "
          f"EOS ignored, "
          f"jaxserve attention {results['jaxserve']['attention_backend']}\n")
    print("| engine | seconds | requests/s | output tokens/s | total tokens/s |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        s = r["seconds"]
        r |= {"requests_per_s": len(prompts) / s, "output_tokens_per_s": num_out / s,
              "total_tokens_per_s": (num_in + num_out) / s}
        print(f"| {name} | {s:.1f} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
              f"{r['total_tokens_per_s']:.1f} |")
    if "hf_transformers" in results:
        ratio = results["hf_transformers"]["seconds"] / results["jaxserve"]["seconds"]
        print(f"\njaxserve / HF output throughput: {ratio:.2f}x")
    print("\n".join(results["jaxserve"]["utilization"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
