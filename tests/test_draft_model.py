"""Speculative decoding with a draft model (`draft_model.py`): a smaller model proposes, the target verifies.

Verification makes any draft safe, so the outputs must equal the target's alone, token for token (greedy,
stops of every kind, logprobs, seeded random sampling: the engine keys each draw by seed and position).
A draft that is the target itself must have (nearly) every draft accepted: that proves the proposer's
K/V bookkeeping (the catch-up of accepted tokens, the rollback of rejected drafts), which exactness alone
cannot, since a wrong draft only costs acceptance. The proposer is also driven by hand: its drafts must
be the draft model's greedy continuation of the request's tokens after any accept/reject history, and a
full draft pool must cost drafts, never a request. No compilation may happen after warm-up.

The models are tiny random llamas whose greedy tokens depend on the whole context (test_engine_core.py
says why): the target, and a draft with other weights, one layer and half the width.
"""

from __future__ import annotations

import dataclasses
import random

import jax
import pytest

from jaxserve import LLM, SamplingParams

from jaxserve.spec_decode import draft_model
from jaxserve.runner.compilation import forbid_compilation, num_compilations
from jaxserve.spec_decode.draft_model import DraftModelProposer, draft_engine_config
from jaxserve.config.engine_config import EngineConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.weights import load_model
from tiny_models import make_tiny_model

MAX_MODEL_LEN, PAGE_SIZE, K = 256, 8, 3
# Prompts over 16 tokens are chunked (one prefill bucket); 8 sequences at most. The draft's pool is
# min(8 sequences of 32 pages, the target's 256 pages): a draft of the target's shape then compiles to
# the target's executables, found in the session's compilation cache.
BASE = dict(max_model_len=MAX_MODEL_LEN, block_size=PAGE_SIZE, forbid_compilation_after_warmup=True,
            max_num_seqs=8, max_num_batched_tokens=16, min_decode_bucket=8, num_kv_pages=256)
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def speculative(draft_dir) -> dict:
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K, "disable_by_batch_size": 8}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """(target, draft): the draft has its own weights, one layer, half the width and heads."""
    target, draft = tmp_path_factory.mktemp("draft_target"), tmp_path_factory.mktemp("draft_small")
    make_tiny_model("llama", target, attention_std=0.3, embedding_std=1.0)
    make_tiny_model("llama", draft, seed=1, attention_std=0.3, embedding_std=1.0, num_hidden_layers=1,
                    hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return target, draft


@pytest.fixture(scope="module")
def engines(model_dirs) -> dict[str, LLM]:
    """The target alone, with the small draft, and with itself as its draft; built before any test runs
    one, so each engine's count of compilations since its warm-up covers only the tests' steps. In float32:
    token for token and logprob for logprob is float32's promise. In bfloat16 a row's sums may follow the
    step's shape: a verify step's run of 4 or more rows of one sequence is attended as a prompt's tile, in
    another order than a decode row, so a logprob may move by a bfloat16 rounding (1.1e-3 measured here when
    the matmuls, too, still took rows by the step's row count), as vLLM's do with the batch."""
    target, draft = model_dirs
    exact = BASE | {"dtype": "float32"}
    return {"target": LLM(target, **exact), "draft": LLM(target, **exact, speculative_config=speculative(draft)),
            "self": LLM(target, **exact, speculative_config=speculative(target))}


def _prompts() -> list[list[int]]:
    """8 prompts of 1..70 tokens, two sharing a 20-token prefix, three longer than a step's 16 tokens."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731
    shared = ids(20)
    return [ids(1), ids(3), ids(9), ids(16), shared + ids(5), shared + ids(13), ids(40), ids(70)]


def _ascii_pair(text: str) -> str | None:
    """Two printable ASCII characters of the text (a stop string across a token boundary)."""
    for i in range(2, len(text) - 1):
        if all(c.isascii() and c.isprintable() for c in text[i:i + 2]):
            return text[i:i + 2]
    return None


def _generate(llm: LLM, work: list[tuple[list[int], SamplingParams]], group: int) -> list:
    """The work's outputs, submitted `group` requests at a time (the engine speculates only where the
    step leaves rows free: at most 8 rows in all)."""
    outputs = []
    for start in range(0, len(work), group):
        chunk = work[start:start + group]
        outputs += llm.generate([{"prompt_token_ids": p} for p, _ in chunk], [params for _, params in chunk],
                                use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def _workload(target: LLM) -> list[tuple[list[int], SamplingParams]]:
    """Every kind of request on the 8 prompts, stops taken from a first greedy run of the target."""
    prompts = _prompts()
    first = _generate(target, [(p, GREEDY) for p in prompts], group=8)
    work = []
    for i, (prompt, out) in enumerate(zip(prompts, first)):
        stop_string = _ascii_pair(out.text)
        kinds = [
            GREEDY,
            SamplingParams(temperature=0.0, stop_token_ids=[out.token_ids[5]], max_tokens=MAX_TOKENS),
            SamplingParams(temperature=0.0, max_tokens=1 + i % 3),
            SamplingParams(temperature=0.0, logprobs=2, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=100 + i, logprobs=1, max_tokens=12),
        ]
        if stop_string is not None:
            kinds.append(SamplingParams(temperature=0.0, stop=[stop_string], max_tokens=MAX_TOKENS))
        work += [(prompt, params) for params in kinds]
    return work


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                         w.stop_reason)
        if w.logprobs is not None:
            assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]
            values = lambda logprobs: [v for d in logprobs for v in d.values()]  # noqa: E731
            assert values(g.logprobs) == pytest.approx(values(w.logprobs), abs=1e-4)


def _spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.get_stats()["spec_decode"]
    return stats["num_draft_tokens"], stats["num_accepted_tokens"]


def test_outputs_with_a_draft_model_equal_the_target_alone(engines):
    """Greedy, stop ids, stop strings, short max_tokens, logprobs and seeded random sampling: the same
    tokens, text, finish and stop reasons with the small draft proposing, in pairs and as a full batch.
    The draft disagrees with the target often, so rejected drafts (rollbacks) happen all the time."""
    work = _workload(engines["target"])
    drafts_before, accepted_before = _spec_counts(engines["draft"])
    for group in (2, 8):
        _assert_same(_generate(engines["draft"], work, group), _generate(engines["target"], work, group))
    drafts, accepted = _spec_counts(engines["draft"])
    drafts, accepted = drafts - drafts_before, accepted - accepted_before
    assert drafts > 100 and accepted < drafts  # it speculated, and not every draft was right


def test_a_draft_that_is_the_target_has_its_drafts_accepted(engines):
    """With the target as its own draft every greedy draft is the target's next token, if the proposer's
    K/V is the request's tokens: accepted tokens trail catch-ups, rejected ones (none here, bar rounding)
    roll back. A stale or misplaced K/V entry shows up as rejections."""
    prompts = _prompts()
    work = [(p, dataclasses.replace(GREEDY, max_tokens=MAX_TOKENS + i)) for i, p in enumerate(prompts)]
    drafts_before, accepted_before = _spec_counts(engines["self"])
    got = _generate(engines["self"], work, group=2) + _generate(engines["self"], work[-1:], group=1)
    drafts, accepted = _spec_counts(engines["self"])
    drafts, accepted = drafts - drafts_before, accepted - accepted_before
    _assert_same(got, _generate(engines["target"], work + work[-1:], group=8))
    assert drafts > 100
    assert drafts - accepted <= drafts // 50, (accepted, drafts)


def _running(request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, list(tokens), SamplingParams(temperature=0.0), seed=0, max_tokens=MAX_MODEL_LEN)
    request.status, request.num_admissions = RequestStatus.RUNNING, 1
    return request


def test_proposer_drafts_are_the_draft_models_greedy_continuation(engines):
    """Driven by hand after every kind of history (a first long prompt caught up in several steps, a draft
    rejected at each position, all accepted, steps without speculation in between, a preemption, requests
    of limits 3, 1 and 0 together), the drafts of the target-as-draft proposer are the target's own greedy
    continuation of the request's tokens: its K/V is theirs, none of a rejected draft's left."""
    proposer: DraftModelProposer = engines["self"].engine.proposer
    target = engines["target"]

    def continuation(request: Request, n: int) -> list[int]:
        params = dataclasses.replace(GREEDY, max_tokens=n)
        return _generate(target, [(request.all_token_ids, params)], group=1)[0].token_ids

    rng = random.Random(1)
    a, b, c = (_running(name, [rng.randrange(256) for _ in range(n)]) for name, n in (("a", 70), ("b", 5), ("c", 9)))
    # (drafts the target accepts (all if None), tokens it decodes after them in steps without speculation)
    history = [(None, 0), (0, 0), (1, 0), (2, 0), (None, 0), (1, 3), (2, 0), (0, 2)]
    with forbid_compilation():
        for num_accepted, num_more in history:
            drafts = proposer.propose([a, b, c], [K, 1, 0])
            assert drafts == [continuation(a, K), continuation(b, 1), []]
            # The accepted drafts, then a token of the target's own (the bonus after all of them)
            accepted = drafts[0][:num_accepted]
            a.output_token_ids += accepted + [(continuation(a, K + 1)[len(accepted)] + 1) % 256]
            a.output_token_ids += [rng.randrange(256) for _ in range(num_more)]
            b.output_token_ids += [drafts[1][0], rng.randrange(256)]
        a.num_admissions += 1  # preempted and admitted again: its draft K/V is dropped and recomputed
        assert proposer.propose([a], [2]) == [continuation(a, 2)]
    for request in (a, b, c):
        request.status = RequestStatus.FINISHED_ABORTED
    assert proposer.propose([], []) == []
    assert not proposer.seqs and proposer.pool.num_free_pages == proposer.pool.num_pages - 1


def test_a_full_draft_pool_costs_drafts_not_requests(engines):
    """Nine requests of 250 tokens need 32 draft pages each and the pool has 256: the ninth gets no drafts
    (no error); once the others finish, it gets them, and every page comes back."""
    proposer: DraftModelProposer = engines["self"].engine.proposer
    rng = random.Random(2)
    requests = [_running(f"long-{i}", [rng.randrange(256) for _ in range(250)]) for i in range(9)]
    with forbid_compilation():
        drafts = proposer.propose(requests, [K] * 9)
        assert [len(d) for d in drafts] == [K] * 8 + [0] and proposer.pool.num_free_pages == 0
        for request in requests[:8]:
            request.status = RequestStatus.FINISHED_STOPPED
        assert [len(d) for d in proposer.propose(requests[8:], [K])] == [K]
    requests[8].status = RequestStatus.FINISHED_STOPPED
    proposer.propose([], [])
    assert proposer.pool.num_free_pages == proposer.pool.num_pages - 1


def test_no_compilation_after_warmup(engines):
    """Warm-up compiles the draft's buckets too: speculating steps compile nothing (every engine forbids
    it, so a compile would have raised in the tests above)."""
    for name in ("draft", "self"):
        assert engines[name].warmup_summary["num_draft_executables"] == 2  # decode 8, prefill 16
    before = num_compilations()
    _generate(engines["draft"], [(p, GREEDY) for p in _prompts()[:2]], group=2)
    assert num_compilations() == before
    assert engines["self"].engine.get_stats()["compilations_since_warmup"] == 0


def test_draft_engine_config(engines):
    """The draft's pool: max_num_seqs whole sequences or the target's pool, whichever is smaller, within
    the bytes given, but at least one sequence and a page; its steps as large as the engine's speculating
    batches, on one device, without a prefix cache."""
    spec = SpeculativeConfig(method="draft_model", model="draft", disable_by_batch_size=3)
    draft_cfg = engines["draft"].engine.proposer.runner.model_cfg
    page_bytes = draft_cfg.kv_bytes_per_token("float32") * PAGE_SIZE

    def cfg(max_pool_bytes=None, **settings) -> EngineConfig:
        target = EngineConfig(**(BASE | {"dtype": "float32"} | settings))
        return draft_engine_config(spec, target, None, draft_cfg, max_pool_bytes)

    assert (cfg().num_kv_pages, cfg().max_num_seqs, cfg().speculative_config) == (256, 3, None)
    assert not cfg().enable_prefix_caching and cfg().tensor_parallel_size == 1
    assert cfg(num_kv_pages=1000).num_kv_pages == 8 * 32
    assert cfg(num_kv_pages=10, max_model_len=128).num_kv_pages == 17
    assert cfg(40 * page_bytes + 1).num_kv_pages == 40
    assert cfg(page_bytes).num_kv_pages == 33


def test_the_draft_pool_takes_half_the_memory_the_target_left(engines, model_dirs, monkeypatch):
    """On a device that reports its free memory (a GPU, whose pool the target sized to what
    gpu_memory_utilization grants), the draft's pool takes half of what its weights leave of it."""
    _, draft_dir = model_dirs
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(load_model(draft_dir, "float32").params))
    draft_runner = engines["draft"].engine.proposer.runner  # its pages: float32
    page_bytes = draft_runner.model_cfg.kv_bytes_per_token(draft_runner.cfg.kv_cache_dtype) * PAGE_SIZE
    monkeypatch.setattr(draft_model, "free_device_bytes", lambda: weight_bytes + 2 * 40 * page_bytes)
    target = engines["target"].engine
    proposer = DraftModelProposer(SpeculativeConfig(**speculative(draft_dir)), target.model_cfg, target.cfg)
    assert proposer.runner.num_pages - 1 == 40


@pytest.mark.parametrize("problem", ["vocab", "context", "missing"])
def test_bad_draft_models_are_refused_clearly(problem, model_dirs, tmp_path):
    """A draft of another vocabulary, a shorter context than max_model_len, or no model at all: a
    ValueError naming speculative_config and what is wrong, before anything is compiled."""
    target, _ = model_dirs
    draft = tmp_path / "draft"
    if problem == "vocab":
        make_tiny_model("llama", draft, vocab_size=384)
        message = "vocab_size=384 differs from the target's vocab_size=320"
    elif problem == "context":
        make_tiny_model("llama", draft, max_position_embeddings=128)
        message = r"max_position_embeddings=128\) is shorter than max_model_len=256"
    else:
        message = "does not exist"
    with pytest.raises(ValueError, match=message) as error:
        LLM(target, **BASE, warmup=False, speculative_config=speculative(draft))
    assert str(error.value).startswith("speculative_config: ")
