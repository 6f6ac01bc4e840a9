"""Benchmark prompts: a random dataset of given token lengths, a grounded one, or a JSONL file of prompts.

The random dataset follows `vllm bench serve --dataset-name random`: input and output lengths are
drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)], and a prompt is text made
of random vocabulary tokens whose re-encoding has exactly the drawn length, so any OpenAI server
sees the same number of prompt tokens.

The grounded dataset asks the model to repeat, copy or extract from a text that the prompt includes,
so the answer repeats the prompt: the workload prompt lookup ("ngram" speculation) speeds up. Its
texts are built here, with no download, from the seed: sentences of a built-in list, shuffled and
joined to about the drawn input length, every prompt's text a different one (a server's prefix cache
cannot serve one prompt from another beyond the instruction's first line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, by the benchmark's tokenizer (the server's usage is preferred when sent)
    output_len: int  # max_tokens to ask for
    json_schema: dict | None = None  # asked for as response_format (structured output), if set


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    if length < 1:
        raise ValueError(f"lengths must be at least 1, got {length}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    return max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))


def _token_pool(tokenizer) -> list[int]:
    """Ids that decode to text which encodes back to themselves alone (no specials, no partial bytes)."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    pool = [i for i, e in zip(ids, encoded) if e == [i]]
    if not pool:
        raise ValueError("no token of this tokenizer round-trips through its text; use --dataset-path")
    return pool


def _text_of_length(tokenizer, rng: random.Random, length: int, pool: list[int]) -> tuple[str, int]:
    """Text whose encoding is `length` tokens (or as close as 10 repairs get; the count is returned)."""
    ids = [rng.choice(pool) for _ in range(length)]
    for _ in range(10):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        ids = ids[:length] + [rng.choice(pool) for _ in range(length - len(ids))]
    return text, len(ids)


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, prefix_len: int = 0) -> list[BenchRequest]:
    """prefix_len (vLLM's --random-prefix-len): every prompt starts with the same text of that many tokens
    (a shared system prompt or document, what a prefix cache serves), then its own input_len tokens."""
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be at least 0, got {prefix_len}")
    pool = _token_pool(tokenizer)
    rng = random.Random(seed)
    prefix = _text_of_length(tokenizer, rng, prefix_len, pool)[0] if prefix_len else ""
    requests = []
    for _ in range(num_prompts):
        text, num_tokens = _text_of_length(tokenizer, rng, rng.randint(in_lo, in_hi), pool)
        if prefix:
            text = prefix + text
            num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(BenchRequest(text, num_tokens, rng.randint(out_lo, out_hi)))
    return requests


# Plain sentences of different shapes and lengths, so joined texts read like paragraphs, not one repeated pattern.
SENTENCES = (
    "The morning train to the coast was late again, so most of the passengers bought coffee and waited.",
    "A small bakery on the corner sells bread that is still warm at seven o'clock.",
    "Maria planted tomatoes, beans and a row of sunflowers along the back fence.",
    "The library closes early on Fridays during the summer months.",
    "He forgot his umbrella, and the rain started just as he left the office.",
    "Our neighbors adopted a grey cat that sleeps on their porch every afternoon.",
    "The committee agreed to meet again next Tuesday to review the budget.",
    "Fresh snow covered the mountain road, and the buses ran an hour behind schedule.",
    "She keeps a notebook of every book she reads, with a short note about each one.",
    "The old bridge was repaired last year and now carries bicycles as well as cars.",
    "Two students stayed after class to ask about the chemistry experiment.",
    "The museum opened a new room for maps drawn by sailors three centuries ago.",
    "When the power went out, the whole street lit candles and talked on their steps.",
    "A farmer at the market explained how he stores apples through the winter.",
    "The new software update fixed the login problem but made the reports slower.",
    "Every spring the river rises and floods the meadow beside the mill.",
    "The hotel staff carried our bags up four flights of stairs without complaint.",
    "Learning to play the violin takes patience, practice and a teacher who listens.",
    "The children built a fort out of blankets, chairs and three large cushions.",
    "Our flight was cancelled, so we spent the night in a quiet hotel near the airport.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "A strong wind knocked over the sign in front of the hardware store.",
    "He walks his dog around the lake before breakfast, even in January.",
    "The town council voted to turn the empty parking lot into a small park.",
    "Most of the orchestra had never played the piece before the first rehearsal.",
    "She painted the kitchen a pale yellow and hung new curtains by the window.",
    "The ferry leaves the harbor at noon and reaches the island an hour later.",
    "A sudden storm forced the sailing club to bring every boat back to shore.",
    "The clock in the hallway has been five minutes fast for as long as anyone remembers.",
    "They found an old letter inside the wall while they were fixing the house.",
    "The bookstore invites a local author to read from a new book every month.",
    "Our team finished the project two days early and celebrated with pizza.",
    "The path through the forest is marked with small blue signs on the trees.",
    "After the concert, the musicians packed their instruments and drove home in the dark.",
    "A good map, a full water bottle and comfortable shoes make any hike easier.",
    "The garden center sells seeds, tools and advice from people who love plants.",
    "He repaired the bicycle himself, using a manual he found at the library.",
    "The village holds a festival each autumn with music, food and a parade.",
    "Scientists measured the temperature of the lake every hour for a full year.",
    "The restaurant changed its menu, but the soup of the day is still the best thing on it.",
    "She answered every email before lunch and spent the afternoon writing the report.",
    "The puppy chewed one of the shoes and hid the other under the sofa.",
    "A quiet room, a clear plan and a cup of tea help most people study.",
    "The harbor lights came on one by one as the fishing boats returned.",
    "Grandfather told the story of the flood so often that we all knew it by heart.",
    "The train station has a piano that anyone may play while waiting.",
    "Heavy traffic on the highway delayed the delivery of the new desks.",
    "At the end of the day, the shopkeeper counted the money and locked the door.",
)

# Each ends with a cue, so a base model on /v1/completions starts the copy as a chat model does.
GROUNDED_TEMPLATES = (
    "Repeat the following text exactly:\n\n{text}\n\nThe text, repeated exactly:\n",
    "Copy the following paragraph, fixing nothing:\n\n{text}\n\nThe copy:\n",
    "Rewrite this text word for word:\n\n{text}\n\nWord for word:\n",
    "Extract every sentence of the text below, one per line, in their original order:\n\n{text}\n\n"
    "The sentences:\n",
)


def _grounded_text(rng: random.Random, sentence_lens: list[int], num_tokens: int) -> str:
    """Sentences in a shuffled order (reshuffled when they run out) whose summed token counts come closest
    to num_tokens, at least one."""
    chosen, total, order = [], 0, []
    while not chosen or total < num_tokens:
        if not order:
            order = rng.sample(range(len(SENTENCES)), len(SENTENCES))
        i = order.pop()
        chosen.append(i)
        total += sentence_lens[i]
    if len(chosen) > 1 and total - num_tokens > num_tokens - (total - sentence_lens[chosen[-1]]):
        chosen.pop()
    return " ".join(SENTENCES[i] for i in chosen)


def grounded_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                      seed: int = 0) -> list[BenchRequest]:
    """Prompts that ask to repeat, copy or extract from a text they include, each about the drawn input
    length (the instruction counted) and each different from the others."""
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    # Joined sentences are separated by a space, which most tokenizers fold into the next word's token
    sentence_lens = [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in SENTENCES]
    template_lens = [len(tokenizer.encode(t.format(text=""), add_special_tokens=False)) for t in GROUNDED_TEMPLATES]
    rng = random.Random(seed)
    requests, seen = [], set()
    for _ in range(num_prompts):
        for _ in range(100):
            t = rng.randrange(len(GROUNDED_TEMPLATES))
            target = rng.randint(in_lo, in_hi)
            prompt = GROUNDED_TEMPLATES[t].format(text=_grounded_text(rng, sentence_lens, target - template_lens[t]))
            if prompt not in seen:
                break
        else:
            raise ValueError(f"the grounded dataset has fewer than {num_prompts} different prompts of about "
                             f"{input_len} tokens; raise --input-len or lower --num-prompts")
        seen.add(prompt)
        num_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(BenchRequest(prompt, num_tokens, rng.randint(out_lo, out_hi)))
    return requests


DATASETS = {"random": random_requests, "grounded": grounded_requests}


def jsonl_requests(path: str | Path, tokenizer, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """One JSON object per line with a "prompt" (and optionally "output_len"); cycles if too few."""
    rows = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{line_no}: expected a JSON object with a \"prompt\" string") from None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{line_no}: \"prompt\" must be a non-empty string")
        rows.append((prompt, int(row.get("output_len", output_len))))
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return [BenchRequest(p, len(tokenizer.encode(p, add_special_tokens=False)), n)
            for p, n in (rows[i % len(rows)] for i in range(num_prompts))]


def add_dataset_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", choices=list(DATASETS), default="random",
                        help="generated prompts: random tokens, or texts the prompt asks to repeat (grounded)")
    parser.add_argument("--dataset-path", default=None,
                        help="JSONL of {\"prompt\": ...} instead of generated prompts")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=256, help="generated datasets: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="generated datasets: lengths drawn from len*(1 -/+ ratio)")
    parser.add_argument("--random-prefix-len", type=int, default=0,
                        help="random dataset: every prompt starts with the same text of this many tokens, then "
                             "its own --input-len tokens (what a prefix cache serves)")


def requests_from_flags(args: argparse.Namespace, tokenizer, num_prompts: int) -> list[BenchRequest]:
    """num_prompts requests of the dataset `add_dataset_flags`' flags name (and args.seed seeds)."""
    if args.dataset_path:
        if args.dataset_name != "random":
            raise ValueError(f"--dataset-path and --dataset-name {args.dataset_name} exclude each other")
        return jsonl_requests(args.dataset_path, tokenizer, num_prompts, args.output_len)
    if args.dataset_name == "random":
        return random_requests(tokenizer, num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                               prefix_len=args.random_prefix_len)
    if args.random_prefix_len:
        raise ValueError(f"--random-prefix-len is for the random dataset, not {args.dataset_name}")
    return DATASETS[args.dataset_name](tokenizer, num_prompts, args.input_len, args.output_len, args.range_ratio,
                                      args.seed)
