"""Structured output (JSON schemas, regexes, choices, grammars) with the default model, offline.

Each test guards one promise: the output a grammar allows is the only output there is (every JSON
schema's output validates, every regex matches whole, every choice is a choice); a request without a
grammar samples exactly as it would alone; the same holds through sampling, n > 1, logprobs, stop
strings, preemption, prefix caching and asynchronous scheduling; nothing compiles after warm-up; a bad
constraint is refused with a message that names it. The schemas come from a seeded generator.
"""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams

from jaxserve.core import structured_output
from jaxserve.errors import InvalidParameter
from jaxserve.ops.sampling import apply_token_bitmask, sample
from jaxserve.runner.step_inputs import StepInputBuilder

# test_default_model's shapes; float32 by name: a preempted request recomputes its tokens as a prompt, whose
# bfloat16 roundings (dtype auto on an AVX512-BF16 CPU) differ from its decode steps' and may flip a near-tie
ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, dtype="float32")
FIELDS = ["id", "name", "title", "city", "count", "price", "tags", "items", "owner", "status", "score", "level",
          "color", "size", "email", "code", "active", "notes", "rank", "kind"]
PATTERNS = [r"^[A-Z][a-z]{1,8}$", r"^[0-9]{3}-[0-9]{4}$", r"^[a-z]{1,10}@[a-z]{1,10}\.(com|org)$", r"^#[0-9a-f]{6}$"]


def random_schema(seed: int, depth: int = 0) -> dict:
    """An object schema with 2-4 fields, each a bounded string, a patterned string, an enum, an integer
    or number with a range, a boolean, a bounded array or (two levels deep at most) a nested object;
    about 70% of the fields required, no others allowed."""
    rng = random.Random(seed)
    names = rng.sample(FIELDS, rng.randint(2, 4))
    properties = {}
    for i, name in enumerate(names):
        kind = rng.choice(["string", "pattern", "enum", "integer", "number", "boolean", "array"]
                          + (["object"] if depth < 2 else []))
        if kind == "string":
            prop = {"type": "string", "minLength": 1, "maxLength": rng.randint(5, 20)}
        elif kind == "pattern":
            prop = {"type": "string", "pattern": rng.choice(PATTERNS)}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", "small", "large", "open", "closed", 1, 2, None], 3)}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 1000)}
        elif kind == "number":
            prop = {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100.5])}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "array":
            low = rng.randint(0, 2)
            items = rng.choice([{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 8},
                                {"enum": ["a", "b", "c"]}])
            prop = {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(1, 3)}
        else:
            prop = random_schema(seed * 31 + i, depth + 1)
        properties[name] = prop
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def greedy(constraint: StructuredOutputsParams | None = None, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kwargs.pop("max_tokens", 400), structured_outputs=constraint,
                          **kwargs)


@pytest.fixture(scope="module")
def llm():
    return LLM(None, **ENGINE)


@pytest.fixture(scope="module")
def schema_outputs(llm):
    schemas = [random_schema(seed) for seed in range(50)]
    conversations = [ask(f"Fill in this JSON schema with an example: {json.dumps(s)}") for s in schemas]
    outputs = llm.chat(conversations, [greedy(StructuredOutputsParams(json=s)) for s in schemas], use_tqdm=False)
    return schemas, conversations, [o.outputs[0] for o in outputs]


def test_fifty_generated_json_schemas_all_give_output_that_validates(llm, schema_outputs):
    schemas, _, outputs = schema_outputs
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 50
    for schema, out in zip(schemas, outputs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert llm.engine.num_compilations_since_warmup == 0


def test_regex_grammar_and_choice_outputs_are_whole_matches(llm):
    regexes = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{5,30}\.", r"[A-Z][a-z]+ [A-Z][a-z]+"]
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,3}/'
    choices = ["Paris", "London", "Berlin", "Madrid"]
    constraints = ([StructuredOutputsParams(regex=r) for r in regexes] + [StructuredOutputsParams(grammar=grammar)]
                   + [StructuredOutputsParams(choice=choices)] * 2)
    questions = ["Give a phone number.", "Is the sky blue?", "Name a famous scientist.", "What is 12 times 12?",
                 "What is the capital of France?", "What is the capital of Spain?"]
    outs = [o.outputs[0] for o in llm.chat([ask(q) for q in questions], [greedy(c, max_tokens=60) for c in constraints],
                                           use_tqdm=False)]
    for regex, out in zip(regexes, outs):
        assert re.fullmatch(regex, out.text), (regex, out.text)
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,3}\.", outs[3].text), outs[3].text
    assert all(out.text in choices and out.finish_reason == "stop" for out in outs[4:]), [o.text for o in outs[4:]]


def test_free_requests_sample_the_same_tokens_beside_constrained_ones(llm):
    """The bitmask of a constrained row touches no other row: greedy free requests give the same tokens
    with constrained neighbours as alone, and no executable is compiled for the mix."""
    free = [ask("Write a haiku about the sea."), ask("List three fruits.")]
    alone = [o.outputs[0].token_ids for o in llm.chat(free, greedy(max_tokens=24), use_tqdm=False)]
    constrained = [ask("Describe a cat as JSON."), ask("Pick a colour.")]
    mixed = llm.chat([free[0], constrained[0], free[1], constrained[1]],
                     [greedy(max_tokens=24), greedy(StructuredOutputsParams(json_object=True), max_tokens=24),
                      greedy(max_tokens=24), greedy(StructuredOutputsParams(choice=["red", "blue"]))], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert mixed[3].outputs[0].text in ("red", "blue")
    assert llm.engine.num_compilations_since_warmup == 0


def test_sampled_outputs_with_n_seeds_logprobs_and_stop_strings_still_validate(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=80, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=schema))
    first = llm.chat(ask("Describe a person as JSON."), params, use_tqdm=False)[0].outputs
    again = llm.chat(ask("Describe a person as JSON."), params, use_tqdm=False)[0].outputs
    assert [o.token_ids for o in first] == [o.token_ids for o in again]  # seeded: the same samples
    for out in first:
        jsonschema.validate(json.loads(out.text), schema)
        assert len(out.logprobs) == len(out.token_ids)
        for token, entry in zip(out.token_ids, out.logprobs):
            assert np.isfinite(entry[token])  # the sampled token was allowed, so its logprob is finite
    # A stop string ends a constrained request like any other, leaving the text before it
    stopped = llm.chat(ask("Give a phone number."), greedy(StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
                                                            stop=["-"]), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[0-9]{3}", stopped.text) and stopped.stop_reason == "-", stopped.text


def test_preemption_prefix_caching_and_async_scheduling_keep_the_constrained_greedy_output(schema_outputs):
    """A pool too small for the batch preempts requests mid-output (their grammars keep their place),
    the shared chat prefix is found in the cache, and async scheduling reads constrained steps before
    scheduling the next: the first 8 schemas' greedy outputs equal those of the ample, synchronous run."""
    schemas, conversations, expected = schema_outputs
    small = LLM(None, **ENGINE, num_kv_pages=40, async_scheduling=True)
    outs = small.chat(conversations[:8], [greedy(StructuredOutputsParams(json=s)) for s in schemas[:8]],
                      use_tqdm=False)
    stats = small.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert [o.outputs[0].text for o in outs] == [o.text for o in expected[:8]]
    assert small.engine.num_compilations_since_warmup == 0


@pytest.mark.parametrize("constraint, problem", [
    (dict(json='{"type": "object", "properties": '), "not valid JSON"),
    (dict(json={"type": "nonsense"}), "nonsense"),
    (dict(regex="a(b"), "unclosed group"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
    (dict(choice=[]), "choice"),
    (dict(json={"type": "object"}, regex="x"), "exactly one"),
])
def test_bad_constraints_are_refused_naming_the_problem(llm, constraint, problem):
    with pytest.raises(InvalidParameter, match=re.escape(problem)) as error:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
        llm.engine.make_request([1, 2, 3], params)
    assert error.value.param == "structured_outputs"
    assert llm.generate("Hi", greedy(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_grammars_are_compiled_once_per_source(llm):
    grammars = llm.engine.grammars
    a = grammars.compile(StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    b = grammars.compile(StructuredOutputsParams(json='{"required": ["a"], "type": "object"}'))
    assert a is b
    assert grammars.compile(StructuredOutputsParams(regex="[a-z]+")) is not a


def test_the_bitmask_bans_exactly_the_tokens_it_leaves_out():
    rng = np.random.default_rng(0)
    vocab = 100
    bitmask = rng.integers(-2**31, 2**31, (3, -(-vocab // 32)), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # an unconstrained row
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    masked = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(masked, np.where(allowed, logits, -np.inf))
    assert np.isfinite(masked[1]).all()


@pytest.mark.parametrize("branches", [True, False], ids=["cpu-branches", "gpu-selects"])
def test_the_sampler_and_its_vocabulary_split_honour_the_bitmask(branches):
    """Greedy and random rows draw only allowed tokens, on one device and with the vocabulary split
    over two (tensor parallelism), and a row without a grammar is untouched."""
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxserve.parallel.tensor_parallel import vocab_sharded_sample

    vocab = 1000
    builder = StepInputBuilder(SimpleNamespace(vocab_size=vocab, eos_token_ids=(0,)),
                               SimpleNamespace(max_model_len=8, max_num_seqs=4))
    t = builder.empty_sampling(4)
    t.temperature[2:] = 1.0
    t.seeds[:] = np.arange(4)
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(4, vocab)).astype(np.float32))
    allowed = [rng.choice(vocab, 3, replace=False) for _ in range(4)]
    t.token_bitmask[:] = 0
    for row, ids in enumerate(allowed):
        bits = np.zeros(32 * builder.bitmask_words, np.uint8)
        bits[ids] = 1
        t.token_bitmask[row] = np.packbits(bits, bitorder="little").view(np.int32)
    t.token_bitmask[1] = -1
    t = jax.tree.map(jnp.asarray, t)
    one = sample(logits, t, branches).token_ids
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    split = jax.jit(jax.shard_map(
        lambda lg, tt: vocab_sharded_sample(lg, tt, vocab_size=vocab, branches=branches),
        mesh=mesh, in_specs=(P(None, "model"), P()), out_specs=P(), check_vma=False))(logits, t)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(split.token_ids))
    for row in (0, 2, 3):
        assert int(one[row]) in allowed[row]
    assert int(one[1]) == int(jnp.argmax(logits[1]))  # greedy and unconstrained: the plain argmax


def test_params_hold_their_compiled_grammar_whatever_the_cache_evicts(monkeypatch):
    """The server compiles a request's grammar on a worker thread, then admits it on the event loop: a
    grammar that other clients' evicted from the cache in between must not be compiled again there. The
    held grammar is not part of the params' value (equal, hashed, copied and pickled without it)."""
    import copy
    import pickle

    from tiny_models import VOCAB_SIZE, byte_tokenizer

    monkeypatch.setattr(structured_output, "_CACHE_SIZE", 1)
    compiled = []
    real = StructuredOutputsParams.llguidance_grammar
    monkeypatch.setattr(StructuredOutputsParams, "llguidance_grammar",
                        lambda self: compiled.append(self.regex) or real(self))
    grammars = structured_output.Grammars(byte_tokenizer(), VOCAB_SIZE)
    validated = StructuredOutputsParams(regex="ab+")
    grammars.compile(validated)
    grammars.compile(StructuredOutputsParams(regex="cd+"))  # another client's grammar takes the only place
    matcher = grammars.matcher(validated)  # admission
    assert compiled == ["ab+", "cd+"]
    allowed = np.zeros((1, grammars.words), np.int32)
    matcher.fill(allowed, 0)
    assert list(structured_output.allowed_token_ids(allowed[0])) == byte_tokenizer().encode("a")

    for twin in (StructuredOutputsParams(regex="ab+"), copy.deepcopy(validated), pickle.loads(pickle.dumps(validated))):
        assert twin == validated and hash(twin) == hash(validated) and twin._compiled is None
    other = structured_output.Grammars(byte_tokenizer(), VOCAB_SIZE)  # another tokenizer's grammar is its own
    other.compile(validated)
    assert compiled == ["ab+", "cd+", "ab+"] and validated._compiled[0] is other
