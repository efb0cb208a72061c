"""What every task produces (a :class:`Sample`) and the helpers the task modules share.

Prompts follow RULER: a template with ``{context}`` and ``{query}``, an answer prefix the model
continues, string-match recall scoring. When the tokenizer has a chat template the task text is
the user message and the answer prefix opens the assistant turn, as RULER does with chat models.

The prompt is tokenized as two pieces, context then question, so that ``question_start`` is an
exact token index: everything before it is the context (prefilled exactly under setup B),
everything from it on is the question (sparse under ``phase="question"``).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..metrics import string_match_all, string_match_part

SCORERS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "all": string_match_all,
    "part": string_match_part,
}

# Length fit: the prompt has at most the requested tokens and at least this fraction of them.
LENGTH_TOLERANCE = 0.02

NOISE_SENTENCE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# The noise haystack in units of one short sentence, so lengths can be met within 2% at 512 tokens.
NOISE_UNITS = tuple(u + "." for u in NOISE_SENTENCE.rstrip(".").split(". "))

_QUESTION_MARK = "\u2063KVSIEVE_QUESTION\u2063"


@dataclass(frozen=True)
class Sample:
    """One prompt of one task at one length, with everything needed to run and score it.

    ``input_ids[:question_start]`` is the context, the rest the question (ending with the answer
    prefix). ``gold`` are the reference strings, scored with RULER's string-match recall
    (``metric`` ``"all"``: mean over references, ``"part"``: best reference). ``target`` is the
    gold continuation used for teacher-forced agreement; ``max_new_tokens == 0`` marks a
    teacher-forced-only sample (no generation, no score).
    """

    task: str
    index: int
    length: int
    input_ids: tuple[int, ...]
    question_start: int
    context_text: str
    question_text: str
    answer_prefix: str
    gold: tuple[str, ...]
    target: str
    max_new_tokens: int
    metric: str
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def prompt_text(self) -> str:
        return self.context_text + self.question_text

    def score(self, prediction: str) -> float | None:
        if self.max_new_tokens == 0:
            return None
        return SCORERS[self.metric](prediction, self.gold)

    def fingerprint(self) -> str:
        """A hash of the token ids and gold answers: a resumed cell must be about the same prompt."""
        h = hashlib.sha256()
        h.update(",".join(map(str, self.input_ids)).encode())
        h.update(b"|" + str(self.question_start).encode() + b"|" + "\x00".join(self.gold).encode())
        return h.hexdigest()[:16]


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    """A generator private to one sample: samples do not depend on which others were made."""
    digest = hashlib.sha256(f"kvsieve-eval|{seed}|{task}|{length}|{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def tokenizer_key(tokenizer: Any) -> str:
    return f"{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}|{type(tokenizer).__name__}"


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class PromptParts:
    context_text: str
    question_text: str
    context_ids: tuple[int, ...]
    question_ids: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)

    def sample_fields(self) -> dict[str, Any]:
        """The ``Sample`` fields that come from the prompt: its ids, the question's start, both texts."""
        return {"input_ids": self.context_ids + self.question_ids, "question_start": len(self.context_ids),
                "context_text": self.context_text, "question_text": self.question_text}


def build_prompt(tokenizer: Any, context_message: str, question_message: str, answer_prefix: str) -> PromptParts:
    """Context and question pieces of the final prompt (chat template applied when there is one).

    ``context_message + question_message`` is the user message; the answer prefix follows the
    generation prompt. With no chat template, the prompt is the raw text (plus BOS if the
    tokenizer adds one) and the answer prefix follows directly, as in RULER's base-model mode.
    """
    if has_chat_template(tokenizer):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": context_message + _QUESTION_MARK + question_message}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if rendered.count(_QUESTION_MARK) != 1:
            raise ValueError("tokenizer: the chat template altered the task message; cannot locate the question")
        context_text, question_text = rendered.split(_QUESTION_MARK)
        question_text += answer_prefix.lstrip()
        context_ids = tokenizer(context_text, add_special_tokens=False)["input_ids"]
    else:
        context_text = context_message
        question_text = question_message + answer_prefix
        context_ids = tokenizer(context_text, add_special_tokens=True)["input_ids"]
    question_ids = tokenizer(question_text, add_special_tokens=False)["input_ids"]
    return PromptParts(context_text, question_text, tuple(context_ids), tuple(question_ids))


def fit_length(build: Callable[[int], PromptParts], length: int, upper: int, what: str,
               check: bool = True) -> tuple[int, PromptParts]:
    """The largest unit count ``n`` in [0, upper] whose prompt ``build(n)`` has at most ``length`` tokens.

    Binary search over full tokenizations (exact, and cheap next to one prefill). Raises when
    even the empty context is too long, or when the best prompt is shorter than the tolerance
    allows (the haystack ran out).
    """
    lo_parts = build(0)
    if lo_parts.n_tokens > length:
        raise ValueError(
            f"length: {length} tokens is too short for {what}: its prompt without any context already has "
            f"{lo_parts.n_tokens} tokens"
        )
    lo, hi = 0, upper
    best = lo_parts
    while lo < hi:
        mid = (lo + hi + 1) // 2
        parts = build(mid)
        if parts.n_tokens <= length:
            lo, best = mid, parts
        else:
            hi = mid - 1
    if check and best.n_tokens < (1 - LENGTH_TOLERANCE) * length:
        raise ValueError(
            f"length: could only build a {best.n_tokens}-token prompt for {what} (requested {length}); "
            "the haystack is too small or its units too coarse for this length"
        )
    return lo, best


def insert_at_depths(units: Sequence[str], unit_tokens: Sequence[int], inserts: Sequence[str],
                     depths: Sequence[float], sentence_boundaries: bool = False) -> list[str]:
    """``units`` with ``inserts[i]`` placed at the unit boundary nearest to token depth ``depths[i]``.

    Depth is the fraction of the haystack's tokens before the insert (0 = start, 1 = end). With
    ``sentence_boundaries`` only boundaries after a unit ending a sentence (or the two ends) qualify.
    """
    total = sum(unit_tokens)
    cumulative = [0]
    for t in unit_tokens:
        cumulative.append(cumulative[-1] + t)
    allowed = [j for j in range(len(cumulative))
               if not sentence_boundaries or j in (0, len(units)) or units[j - 1].endswith((".", "!", "?"))]
    positions = []
    for depth in depths:
        goal = depth * total
        positions.append(min(allowed, key=lambda j: abs(cumulative[j] - goal)))
    out: list[str] = []
    order = sorted(range(len(inserts)), key=lambda i: (positions[i], i))
    k = 0
    for j in range(len(units) + 1):
        while k < len(order) and positions[order[k]] == j:
            out.append(inserts[order[k]])
            k += 1
        if j < len(units):
            out.append(units[j])
    return out


# ---- real-text resources -------------------------------------------------------------------------

@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The Paul Graham essays as one stream of words (whitespace flattened, as RULER's haystack)."""
    from ...assets import essay_texts

    return tuple(w for text in essay_texts() for w in text.split())


_UNIT_TOKEN_CACHE: dict[tuple[str, str], tuple[int, ...]] = {}


def noise_units(tokenizer: Any, n: int) -> tuple[list[str], list[int]]:
    """The first ``n`` short sentences of the repeated noise haystack and their token counts."""
    key = (tokenizer_key(tokenizer), "noise")
    if key not in _UNIT_TOKEN_CACHE:
        ids = tokenizer([" " + u for u in NOISE_UNITS], add_special_tokens=False)["input_ids"]
        _UNIT_TOKEN_CACHE[key] = tuple(len(i) for i in ids)
    counts = _UNIT_TOKEN_CACHE[key]
    k = len(NOISE_UNITS)
    return [NOISE_UNITS[j % k] for j in range(n)], [counts[j % k] for j in range(n)]


def essay_word_tokens(tokenizer: Any) -> tuple[int, ...]:
    """Token count of each essay word when it follows a space (cached per tokenizer)."""
    key = (tokenizer_key(tokenizer), "essay")
    if key not in _UNIT_TOKEN_CACHE:
        ids = tokenizer([" " + w for w in essay_words()], add_special_tokens=False)["input_ids"]
        _UNIT_TOKEN_CACHE[key] = tuple(len(i) for i in ids)
    return _UNIT_TOKEN_CACHE[key]


@lru_cache(maxsize=1)
def essay_vocabulary() -> tuple[str, ...]:
    """Plain lowercase English words of the essays (4-10 letters, seen at least 3 times), sorted.

    RULER draws keys and list words from the ``wonderwords`` package; kvsieve draws them from the
    essays instead, so no extra dependency is needed.
    """
    from collections import Counter

    from ...assets import essay_texts

    counts = Counter(w for text in essay_texts() for w in re.findall(r"\b[a-z]{4,10}\b", text))
    return tuple(sorted(w for w, c in counts.items() if c >= 3))


def random_key_word(rng: random.Random, taken: set[str]) -> str:
    """A RULER-style ``adjective-noun`` key, here two distinct essay words joined by a hyphen."""
    vocab = essay_vocabulary()
    while True:
        a, b = rng.sample(vocab, 2)
        key = f"{a}-{b}"
        if key not in taken:
            taken.add(key)
            return key


def random_number(rng: random.Random, taken: set[str], digits: int = 7) -> str:
    while True:
        value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if value not in taken:
            taken.add(value)
            return value


def random_uuid(rng: random.Random, taken: set[str]) -> str:
    import uuid

    while True:
        value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if value not in taken:
            taken.add(value)
            return value


def template_parts(template: str, context: str, **fields: Any) -> tuple[str, str]:
    """(message up to and including the context, the rest) of a RULER template with ``{context}``."""
    head, sep, tail = template.partition("{context}")
    if not sep:
        raise ValueError("template: expected a '{context}' field")
    return head.format(**fields) + context, tail.format(**fields)
