"""The peer of `jaxserve bench throughput --hf-baseline`: Hugging Face transformers' batched `generate`
on the same prompts, the way a notebook user would batch it.

Static batches of `batch_size` prompts, left-padded, greedy, each request's own number of output
tokens (the batch runs to its longest; EOS is ignored, as with `--ignore-eos`); on a GPU when PyTorch
sees one (CUDA), with its default (SDPA) attention. One untimed warm-up call, as jaxserve's compiles
are untimed too. Needs torch (the `gguf` or `test` extra).
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm.auto import tqdm


def run_hf(prompts: list[list[int]], output_lens: list[int], model: str | None, dtype: str,
           batch_size: int, show_progress: bool = True) -> dict:
    """Generates for every prompt; returns seconds, device and the tokens it produced."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.weights import default_model_path

    path = default_model_path() if model is None else Path(model)
    try:
        if path.suffix == ".gguf":
            hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=getattr(torch, dtype))
        else:
            hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except OSError as e:  # a jaxserve checkpoint, or a directory transformers cannot read
        raise ValueError(f"HF transformers cannot load {path} for --hf-baseline: {e}") from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_model = hf_model.to(device).eval()
    pad = hf_model.config.pad_token_id or 0
    with torch.no_grad():
        hf_model.generate(input_ids=torch.tensor([prompts[0]], device=device), max_new_tokens=2, do_sample=False,
                          pad_token_id=pad)
    num_output = 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), batch_size), desc="HF generate", unit="batch",
                  disable=not show_progress):
        batch, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                              do_sample=False, pad_token_id=pad)
        num_output += sum(lens)  # the tokens the requests asked for; the rest of a batch's run is padding
    return {"seconds": time.perf_counter() - start, "device": device, "batch_size": batch_size,
            "total_output_tokens": num_output}
