"""--scheduling-policy (vLLM's `scheduling_policy`): a request's priority is honoured only under "priority".
Under the default, "fcfs", a non-zero priority is refused where every request is made
(`LLMEngine.make_request`), offline as over HTTP, so no client can jump the queue or force a preemption.
The ordering itself is tests/test_page_pool.py's; the HTTP 400 is tests/test_server_hardening.py's.
"""

from __future__ import annotations

import argparse

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine_config import EngineConfig, add_engine_flags, engine_config_from_args

ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, block_size=8, num_kv_pages=32)
PROMPTS = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def test_the_flag_takes_vllms_names_and_defaults_to_fcfs():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config_from_args(parser.parse_args([])).scheduling_policy == "fcfs"
    assert engine_config_from_args(parser.parse_args(["--scheduling-policy", "priority"])).scheduling_policy \
        == "priority"
    with pytest.raises(ValueError, match="scheduling_policy='lottery' must be one of"):
        EngineConfig(scheduling_policy="lottery")


def test_offline_priorities_need_the_priority_policy(tiny_model_dir):
    """vLLM's rule and message: a ValueError naming the priority, and nothing is queued."""
    fcfs = LLM(tiny_model_dir("llama"), **ENGINE)
    with pytest.raises(ValueError, match="got priority 1 but priority scheduling is not enabled"):
        fcfs.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 1])
    assert not fcfs.engine.scheduler.has_unfinished and not fcfs.engine.requests
    assert [len(o.outputs[0].token_ids) for o in fcfs.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 0])] \
        == [2, 2]

    ranked = LLM(tiny_model_dir("llama"), **ENGINE, scheduling_policy="priority")
    outputs = ranked.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[1, -1])
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in
                                                         fcfs.generate(PROMPTS, PARAMS, use_tqdm=False)]
