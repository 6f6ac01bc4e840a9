"""LoRA adapters under tensor parallelism (issue 39), over forced CPU devices (conftest asks for 8).

Each adapter's A and B are split as their projections are (B by columns for q/k/v and gate/up, A by
rows for o and down, the delta added before the all-reduce), through a head layout that pads: a tiny
Mistral's 3 KV heads over 2 devices get a zero KV head, and its odd intermediate size a zero column.
Greedy tokens must equal HF + PEFT's in float32 for the base model and three adapters sharing one batch
(two slots: one waits), with nothing compiled after warm-up.
"""

from __future__ import annotations

import pytest

import lora_adapters
import tiny_models
from jaxserve import LLM, SamplingParams
from jaxserve.lora import LoRARequest

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {
    "all8": dict(rank=8, targets=ALL, seed=11),
    "mlp16": dict(rank=16, targets=("gate_proj", "up_proj", "down_proj"), seed=12),
    "attn16": dict(rank=16, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True, seed=13),
}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora_tp_base")
    tiny_models.make_tiny_model("mistral", base, attention_std=0.3, embedding_std=1.0, num_attention_heads=6,
                                num_key_value_heads=3, head_dim=16, intermediate_size=129)
    loras = {name: LoRARequest(name, i, str(lora_adapters.make_peft_adapter(base, tmp_path_factory.mktemp(name),
                                                                              **kwargs)))
             for i, (name, kwargs) in enumerate(ADAPTERS.items(), 1)}
    return base, loras


def test_tp2_greedy_tokens_equal_peft_in_a_mixed_batch(setup):
    base, loras = setup
    llm = LLM(str(base), dtype="float32", tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16,
              max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, num_kv_pages=48,
              forbid_compilation_after_warmup=True)
    assert llm.engine.runner.parallel is not None
    names = [None, *ADAPTERS]
    prompts = [[(7 * i + 5 * j) % 250 + 3 for j in range(11 + 2 * i)] for i in range(len(names))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False,
                           lora_request=[None if n is None else loras[n] for n in names])
    expected = [lora_adapters.peft_greedy(base, None if n is None else loras[n].lora_path, p, MAX_TOKENS,
                                          eos_id=tiny_models.EOS_ID) for n, p in zip(names, prompts)]
    assert len({tuple(e) for e in expected}) == len(expected)  # every adapter changes the tokens
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.num_compilations_since_warmup == 0
