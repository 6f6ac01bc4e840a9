"""Offline throughput: `LLM.generate` on N random prompts beside HF transformers' batched generate.

Both engines get the same prompts (random token ids, input lengths uniform in [min, max], a fixed
number of output tokens, EOS ignored) on the same machine in the same run. HF runs static batches
of --hf-batch-size prompts, left-padded, which is how a notebook user would batch it.

    python benchmarks/bench_throughput.py --num-prompts 256 --input-len 32 512 --output-len 128
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

    llm = LLM(None, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return {"seconds": elapsed, "stats": {k: v for k, v in llm.get_stats().items() if k != "compiled_shapes"}}


def run_hf(prompts, output_len: int, batch_size: int) -> dict:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from jaxserve.weights import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    pad = model.config.pad_token_id or 0
    with torch.no_grad():  # untimed warm-up, as jaxserve's compile is untimed too
        model.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, pad_token_id=pad)
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="HF generate", unit="batch"):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        assert out.shape[1] == width + output_len
    return {"seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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

    prompts = make_prompts(args.num_prompts, tuple(args.input_len), 49152, args.seed)
    num_in = sum(map(len, prompts))
    num_out = args.output_len * len(prompts)
    results = {"jaxserve": run_jaxserve(prompts, args.output_len, args)}
    if not args.skip_hf:
        results["hf_transformers"] = run_hf(prompts, args.output_len, args.hf_batch_size)

    print(f"\n{len(prompts)} prompts, input {args.input_len[0]}..{args.input_len[1]} "
          f"(mean {statistics.mean(map(len, prompts)):.0f}), output {args.output_len}, float32, greedy, EOS ignored\n")
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
