"""Speculative decoding (`speculative_config`, jaxserve/spec_decode/speculative.py): drafts verified in the step.

Nothing a client sees may change but the speed: the workload of test_async_scheduling.py (every stop
kind, min_tokens, penalties, logprobs, n > 1, logit_bias, max_tokens 1 and 2, chunked prefill, prefix
caching and, in the small pool, preemption) gives the same tokens, text, reasons and logprobs with prompt
lookup on as off, seeded sampling included (the sampler keys a row's draw by its seed and position);
random sampling is checked against the model's exact distribution with a chi-square test; pages of
rejected drafts come back; speculation stays off in batches above `disable_by_batch_size`.

The engines run 32 sequences at most and the work goes in waves of 8, so every wave leaves room for
drafts (verification rows share the largest decode bucket with the sequences' own rows).
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import openai
import pytest
import scipy.stats
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine_config import EngineConfig
from jaxserve.errors import InvalidParameter
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.spec_decode.speculative import accepted_run, ngram_propose
from server_helpers import API_KEY, TINY_FLAGS, metric, metric_samples, run_server
from test_async_scheduling import CONFIGS, assert_same_outputs, random_prompts, workload
from tiny_models import make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 32}
WIDE = dict(max_num_seqs=32)  # room for drafts beside a wave of 8 sequences


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_spec")
    return directory, make_tiny_model("llama", directory, attention_std=0.3, embedding_std=1.0)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engines(request, model_dir) -> tuple[LLM, LLM]:
    """(speculation off, prompt lookup on), each fresh, in float32: token for token and logprob for logprob
    is float32's promise. In bfloat16 a row's sums may follow the step's shape (a verify step's run of 4 or
    more rows of one sequence is attended as a prompt's tile; until every bfloat16 matmul row took the AMX
    tiles, the matmuls too followed the step's row count), so a logprob may move by a bfloat16 rounding
    (measured: 5e-3), as vLLM's do with the batch."""
    config = dict(CONFIGS[request.param], **WIDE, dtype="float32")
    return LLM(model_dir[0], **config), LLM(model_dir[0], **config, speculative_config=NGRAM)


def _run_in_waves(llm: LLM, work, wave: int = 8) -> list:
    outputs = []
    for start in range(0, len(work), wave):
        part = work[start:start + wave]
        results = llm.generate([{"prompt_token_ids": p} for p, _ in part], [params for _, params in part],
                               use_tqdm=False)
        outputs += [c for o in results for c in o.outputs]
    return outputs


def test_outputs_are_the_same_with_prompt_lookup(engines):
    """Every kind of request of test_async_scheduling.py's workload, token for token, with drafts both
    accepted and rejected along the way, no page leaked and nothing compiled after warm-up."""
    base, spec = engines
    work = workload(base)
    assert workload(spec) == work
    stats_before = dict(spec.get_stats()["spec_decode"])
    assert_same_outputs(_run_in_waves(base, work), _run_in_waves(spec, work))
    s, stats = spec.get_stats(), spec.get_stats()["spec_decode"]
    drafted = stats["num_draft_tokens"] - stats_before["num_draft_tokens"]
    accepted = stats["num_accepted_tokens"] - stats_before["num_accepted_tokens"]
    assert 0 < accepted < drafted, stats  # both outcomes happened
    per_pos = stats["num_accepted_tokens_per_pos"]  # a draft is accepted only after the ones before it
    assert per_pos[0] > 0 and per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == stats["num_accepted_tokens"]
    assert s["num_used_pages"] == 0 and s["compilations_since_warmup"] == 0
    if spec.config.num_kv_pages < 200:
        assert s["num_preemptions"] > 0


def test_an_abort_mid_run_keeps_a_prefix_and_frees_every_page(engines):
    base, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [p + p[:6] for p in random_prompts(seed=3)[:4]]  # repeats: prompt lookup finds drafts
    full = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    engine = spec.engine
    requests = [engine.add_request(p, params) for p in prompts]
    victim = requests[1]
    while engine.has_unfinished:
        engine.step()
        if len(victim.output_token_ids) >= 3 and not victim.status.is_finished:
            engine.abort_request(victim.request_id)
    assert victim.finish_reason == "abort" and victim.output_token_ids == full[1][:len(victim.output_token_ids)]
    assert [r.output_token_ids for i, r in enumerate(requests) if i != 1] == [t for i, t in enumerate(full) if i != 1]
    assert engine.pool.num_used_pages == 0 and not engine.requests


class _TableProposer:
    """Proposes, for a request whose tokens are a key of `table`, that entry's drafts."""

    def __init__(self, table: dict[tuple[int, ...], list[int]]):
        self.table, self.calls = table, 0

    def propose(self, requests, limits):
        self.calls += 1
        return [self.table.get(tuple(r.all_token_ids), [])[:limit] for r, limit in zip(requests, limits)]


def test_random_sampling_with_drafts_follows_the_models_distribution(model_dir):
    """temperature 1, top_k 3, three tokens per request: after the first token, the step gets the most
    likely second token as a draft; the joint distribution of the three tokens over 2400 seeds matches the
    model's (computed by the PyTorch reference), chi-square p > 1e-4, whether the draft was accepted or not."""
    directory, torch_model = model_dir
    prompt = [5, 17, 99, 42, 7, 250, 13]
    llm = LLM(directory, **dict(CONFIGS["ample"], **WIDE), speculative_config=NGRAM)

    def top3(prefix):
        with torch.no_grad():
            logits = torch_model(torch.tensor([prefix])).logits[0, -1].double()
        values, ids = torch.topk(logits, 3)
        return ids.tolist(), torch.softmax(values, 0).tolist()

    joint, table = {}, {}
    ids1, p1 = top3(prompt)
    for t1, q1 in zip(ids1, p1):
        ids2, p2 = top3(prompt + [t1])
        table[tuple(prompt + [t1])] = [ids2[0]]  # the draft: the likeliest second token
        for t2, q2 in zip(ids2, p2):
            ids3, p3 = top3(prompt + [t1, t2])
            for t3, q3 in zip(ids3, p3):
                joint[t1, t2, t3] = q1 * q2 * q3
    llm.engine.proposer = proposer = _TableProposer(table)
    counts = dict.fromkeys(joint, 0)
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s) for s in range(2400)]
    for start in range(0, len(params), 12):
        for out in llm.generate([{"prompt_token_ids": prompt}] * 12, params[start:start + 12], use_tqdm=False):
            key = tuple(out.outputs[0].token_ids)
            assert key in counts, f"{key} is outside the top-3 support"
            counts[key] += 1
    stats = llm.get_stats()["spec_decode"]
    assert proposer.calls > 0 and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    observed = np.array(list(counts.values()), float)
    expected = np.array([joint[k] for k in counts]) * len(params)
    big = expected >= 5
    observed = np.append(observed[big], observed[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    chi2 = float(((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
    assert chi2 < scipy.stats.chi2.isf(1e-4, len(expected) - 1), (chi2, observed, expected.round())


def test_speculation_is_off_in_batches_above_disable_by_batch_size(model_dir):
    llm = LLM(model_dir[0], **dict(CONFIGS["ample"], **WIDE), speculative_config=dict(NGRAM, disable_by_batch_size=2))
    proposer = llm.engine.proposer = _TableProposer({})
    steps = []
    propose = llm.engine._propose

    def logged(output):
        drafts = propose(output)
        steps.append((len(output.scheduled), proposer.calls))
        return drafts

    llm.engine._propose = logged
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(seed=4)[:5]], params, use_tqdm=False)
    calls = [b - a for (_, a), (_, b) in itertools.pairwise([(0, 0)] + steps)]
    assert any(n <= 2 for n, _ in steps) and any(n > 2 for n, _ in steps)
    assert all(call == 0 for (n, _), call in zip(steps, calls) if n > 2)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 2, 3])
    assert ngram_propose(tokens, 1, 3, 2) == [5, 6]  # "2 3" last seen before "5 6" (its latest match)
    assert ngram_propose(tokens, 3, 3, 2) == []  # no earlier "7 2 3"
    assert ngram_propose(np.array([4, 4, 4]), 1, 2, 5) == [4]  # the run stops at the sequence's end
    assert ngram_propose(np.array([3, 4, 4, 4, 4, 4]), 1, 2, 3) == [4, 4, 4]  # not the latest "4 4": 1 token after
    assert ngram_propose(np.array([8]), 1, 2, 3) == []
    assert accepted_run([5, 6, 7], [5, 6, 8, 1]) == 2 and accepted_run([5], [4, 0]) == 0
    assert accepted_run([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("value, message", [
    ('{"method": "eagle"}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "1 <= min <= max"),
    ('{"method": "draft_model"}', "needs a 'model'"),
    ('{"method": "ngram", "speculative_model": "x"}', "unknown fields ['speculative_model']"),
    ("ngram", "is not JSON"),
])
def test_a_bad_speculative_config_is_named(value, message):
    with pytest.raises(InvalidParameter, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        SpeculativeConfig.parse(value)


def test_speculative_config_defaults_and_its_conflict_with_async_scheduling():
    spec = SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_max": 3})
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 3, 3)
    assert EngineConfig(speculative_config='{"method": "ngram"}').speculative_config.prompt_lookup_min == 5
    with pytest.raises(ValueError, match="synchronous scheduling"):
        EngineConfig(speculative_config={"method": "ngram"}, async_scheduling=True)
    result = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--speculative-config", '{"method": 1}'],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--speculative-config: speculative_config: method must be one of" in result.stderr


def test_a_failing_proposer_costs_the_step_its_drafts_only(model_dir):
    """Drafts only save time: a proposer that raises leaves the step without drafts, and the outputs are
    those of no speculation."""
    config = dict(CONFIGS["ample"], **WIDE)
    llm = LLM(model_dir[0], **config, speculative_config=NGRAM)

    class Broken:
        def propose(self, requests, limits):
            raise RuntimeError("broken proposer")

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p + p[:6]} for p in random_prompts(seed=5)[:3]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.proposer = Broken()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_the_server_streams_several_tokens_a_chunk_and_counts_drafts(tiny_model_dir):
    """`jaxserve serve --speculative-config`: a streamed greedy completion joins to the non-streamed text,
    carries a logprob per token while some chunks hold several tokens, and /metrics counts the drafts."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    with run_server([str(tiny_model_dir("llama")), *TINY_FLAGS, "--speculative-config", spec]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        args = dict(model=client.models.list().data[0].id, prompt="abcabcabcabc", max_tokens=24, temperature=0,
                    logprobs=1, extra_body={"ignore_eos": True})
        whole = client.completions.create(**args).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
        assert "".join(c.text for c in chunks) == whole.text
        per_chunk = [len(c.logprobs.tokens) for c in chunks if c.logprobs]
        assert sum(per_chunk) == 24 == len(whole.logprobs.tokens) and max(per_chunk) > 1, per_chunk
        samples = metric_samples(srv.url)
        assert metric(samples, "jaxserve:spec_decode_num_accepted_tokens_total") > 0
        assert metric(samples, "jaxserve:spec_decode_num_draft_tokens_total") >= metric(
            samples, "jaxserve:spec_decode_num_accepted_tokens_total")
