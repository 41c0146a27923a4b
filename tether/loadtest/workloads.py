"""Seeded request generators for `tether bench`: the prompts are ours (tether/loadtest/data/*.jsonl), nothing is
downloaded, and the same (workload, seed) always yields the same requests.

Workloads:
- single     Chinese and English single-turn prompts of varied length and task, some with explicit length
             constraints ("不超过50字", "in under 30 words") that admission turns into a shorter output budget.
- multiturn  conversations that share a few system prompts (the prefix-cache workload): a random prefix of a
             conversation ending in a user turn.
- long       long-context requests: several passages (repeated to length) followed by a question.
- shared-doc one long shared passage (`SharedDocSpec.tokens`, ~1500 prompt tokens) asked different questions:
             the prompt is the passage, then one question, so every request shares all but its last line (the
             prefix cache's best case; the computed ÷ prompt tokens figure shows what the cache saved).
- synthetic  random English words with input and output lengths drawn uniformly from
             [L * (1 - ratio), L * (1 + ratio)] tokens (like vLLM's random dataset); ignores EOS so every
             request produces exactly its output length.

Every request also draws its sampling: half greedy, half sampled with an explicit seed (so runs repeat).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

WORKLOADS = ("single", "multiturn", "long", "synthetic", "shared-doc")
DEFAULT_MIX = "single:6,multiturn:3,long:1"

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class BenchRequest:
    """One request the load generator sends, with everything the audit needs to replay it."""

    index: int
    workload: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    ignore_eos: bool = False

    def params(self) -> dict[str, Any]:
        """Keyword arguments for `AsyncClient.stream` / `reference.sampling_params` (prompt excluded)."""
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    seed=self.seed, ignore_eos=self.ignore_eos)


@dataclass(frozen=True)
class SyntheticSpec:
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.5

    def bounds(self, length: int) -> tuple[int, int]:
        return max(1, round(length * (1 - self.range_ratio))), max(1, round(length * (1 + self.range_ratio)))


@dataclass(frozen=True)
class LongSpec:
    """Context length of long requests in prompt tokens, drawn uniformly from [min_tokens, max_tokens]."""

    min_tokens: int = 1000
    max_tokens: int = 2000
    output_tokens: int = 32


@dataclass(frozen=True)
class SharedDocSpec:
    """shared-doc: the passage's length in prompt tokens (built once per Workload, the same for every seed, so
    every level and every cluster of a comparison sees the same passage) and each answer's output budget."""

    tokens: int = 1500
    output_tokens: int = 32


def parse_mix(spec: str) -> dict[str, float]:
    """'single:6,multiturn:3' -> weights; a bare name weighs 1; 'mix' is the default mix."""
    if spec.strip() == "mix":
        spec = DEFAULT_MIX
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)} or 'mix'")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"workload weight must be a number: {part!r}") from None
        if w <= 0:
            raise ValueError(f"workload weight must be positive: {part!r}")
        weights[name] = w
    if not weights:
        raise ValueError("no workload given")
    return weights


@cache
def _data(name: str) -> tuple[dict, ...]:
    text = (resources.files("tether.loadtest") / "data" / name).read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


@cache
def _word_pool() -> tuple[str, ...]:
    """Lower-case English words of our own prompts: the vocabulary of synthetic requests."""
    words = {w.lower() for row in _data("single.jsonl") if row["lang"] == "en"
             for w in re.findall(r"[A-Za-z]+", row["prompt"])}
    return tuple(sorted(words))


# Long-context requests: an instruction, the material, then one of these questions.
LONG_HEADS = {"zh": "阅读下面的材料，然后回答问题。\n\n",
              "en": "Read the material below, then answer the question.\n\n"}
LONG_QUESTIONS = {
    "zh": ["问题：根据以上材料，用不超过60字总结主要内容。", "问题：以上材料提到了哪些具体数字？",
           "问题：材料中提到的主要困难是什么？", "问题：如果你是负责人，下一步会怎么做？"],
    "en": ["Question: Based on the material above, summarize the main points in under 60 words.",
           "Question: Which numbers are mentioned in the material above?",
           "Question: What is the main difficulty described above?",
           "Question: If you were in charge, what would you do next?"],
}


# shared-doc: the instruction, then the passage, then one of these questions (different suffixes, one prefix).
SHARED_DOC_HEAD = "Read the report below carefully. Several questions about it follow, one at a time.\n\n"
SHARED_DOC_QUESTIONS = (
    "Summarize the report in under 40 words.",
    "Which numbers does the report mention?",
    "What is the main difficulty the report describes?",
    "Who is involved, according to the report?",
    "Give the report a short title.",
    "List three keywords for the report.",
    "What happened first, according to the report?",
    "Is the tone of the report optimistic or pessimistic? Why?",
    "If you were in charge, what would you do next?",
    "What question does the report leave open?",
    "Explain the report to a child in two sentences.",
    "Which part of the report is most surprising?",
)


def _sampling(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        return {}
    return dict(temperature=rng.choice([0.6, 0.8, 1.0]), top_p=rng.choice([0.0, 0.9]), top_k=rng.choice([0, 40]),
                seed=rng.randrange(1, 2**31))


class Workload:
    """An endless, seeded stream of BenchRequests drawn from a weighted mix of workloads.

    `encode` is the served model's tokenizer: long and synthetic requests are sized in its tokens.
    """

    def __init__(self, mix: dict[str, float], encode: Encode, synthetic: SyntheticSpec = SyntheticSpec(),
                 long: LongSpec = LongSpec(), shared_doc: SharedDocSpec = SharedDocSpec()) -> None:
        self.mix = mix
        self.encode = encode
        self.synthetic = synthetic
        self.long = long
        self.shared_doc = shared_doc
        self._doc: str | None = None

    def stream(self, seed: str | int) -> Iterator[BenchRequest]:
        rng = random.Random(f"tether-bench:{seed}")   # str seeds hash stably across processes
        names, weights = list(self.mix), list(self.mix.values())
        index = 0
        while True:
            name = rng.choices(names, weights)[0]
            yield getattr(self, f"_{name.replace('-', '_')}")(rng, index)
            index += 1

    def take(self, n: int, seed: str | int) -> list[BenchRequest]:
        it = self.stream(seed)
        return [next(it) for _ in range(n)]

    def _single(self, rng: random.Random, index: int) -> BenchRequest:
        row = rng.choice(_data("single.jsonl"))
        return BenchRequest(index, "single", row["prompt"], row["max_tokens"], **_sampling(rng))

    def _multiturn(self, rng: random.Random, index: int) -> BenchRequest:
        conv = rng.choice(_data("chat.jsonl"))
        sys_tag, user, bot = ("系统", "用户", "助手") if conv["lang"] == "zh" else ("System", "User", "Assistant")
        colon = "：" if conv["lang"] == "zh" else ": "
        k = rng.randint(1, len(conv["turns"]))
        lines = [f"{sys_tag}{colon}{conv['system']}", ""]
        for question, answer in conv["turns"][:k - 1]:
            lines += [f"{user}{colon}{question}", f"{bot}{colon}{answer}"]
        lines += [f"{user}{colon}{conv['turns'][k - 1][0]}", f"{bot}{colon}".rstrip()]
        return BenchRequest(index, "multiturn", "\n".join(lines), 64, **_sampling(rng))

    def _long(self, rng: random.Random, index: int) -> BenchRequest:
        lang = rng.choice(["zh", "en"])
        passages = [p["text"] for p in _data("passages.jsonl") if p["lang"] == lang]
        question = rng.choice(LONG_QUESTIONS[lang])
        target = rng.randint(self.long.min_tokens, self.long.max_tokens)
        head = LONG_HEADS[lang]
        tail = f"\n\n{question}"
        budget = target - len(self.encode(head + tail))
        body = self._numbered_passages(passages, rng, budget)
        return BenchRequest(index, "long", head + body + tail, self.long.output_tokens, **_sampling(rng))

    def _numbered_passages(self, passages: list[str], rng: random.Random, budget: int) -> str:
        """Whole passages, numbered, shuffled and repeated, while they fit in `budget` tokens (at least one)."""
        parts: list[str] = []
        used = 0
        while True:
            order = passages[:]
            rng.shuffle(order)
            for p in order:
                piece = f"[{len(parts) + 1}] {p}\n"
                cost = len(self.encode(piece))
                if parts and used + cost > budget:
                    return "".join(parts).rstrip()
                parts.append(piece)
                used += cost

    def shared_passage(self) -> str:
        """The shared-doc passage: English passages of ours, numbered and repeated, while they fit in
        `shared_doc.tokens` prompt tokens (head and question included); seeded by its length alone."""
        if self._doc is None:
            rng = random.Random(f"tether-bench:shared-doc:{self.shared_doc.tokens}")
            passages = [p["text"] for p in _data("passages.jsonl") if p["lang"] == "en"]
            longest = max(len(self.encode(f"\n\nQuestion: {q}")) for q in SHARED_DOC_QUESTIONS)
            budget = self.shared_doc.tokens - len(self.encode(SHARED_DOC_HEAD)) - longest
            self._doc = SHARED_DOC_HEAD + self._numbered_passages(passages, rng, budget)
        return self._doc

    def _shared_doc(self, rng: random.Random, index: int) -> BenchRequest:
        question = rng.choice(SHARED_DOC_QUESTIONS)
        return BenchRequest(index, "shared-doc", f"{self.shared_passage()}\n\nQuestion: {question}",
                            self.shared_doc.output_tokens, **_sampling(rng))

    def _synthetic(self, rng: random.Random, index: int) -> BenchRequest:
        n_in = rng.randint(*self.synthetic.bounds(self.synthetic.input_len))
        n_out = rng.randint(*self.synthetic.bounds(self.synthetic.output_len))
        pool = _word_pool()
        words: list[str] = []
        used = 0
        while used < n_in:   # cost of each word with its separating space; trimmed exactly below
            w = rng.choice(pool)
            used += len(self.encode(w if not words else " " + w))
            words.append(w)
        prompt = " ".join(words)
        while len(self.encode(prompt)) > n_in:
            prompt = prompt[:-1]
        return BenchRequest(index, "synthetic", prompt, n_out, ignore_eos=True, **_sampling(rng))


