"""Task generators and scorers: length, question split, needle placement, perfect/wrong answers."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

from kvsieve.eval import tasks
from kvsieve.eval.tasks import fwe, niah

pytestmark = pytest.mark.model

SCORED = [t for t in tasks.task_names() if not t.startswith("tf_")]
LENGTHS = (512, 1024)


@pytest.fixture(scope="module")
def tok():
    """The default model's tokenizer only (the model itself is not needed here)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from kvsieve.assets import default_model_file

    folder, name = default_model_file()
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


def ntok(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task", tasks.task_names())
@pytest.mark.parametrize("length", LENGTHS)
def test_prompt_length_and_question_split(tok, task, length):
    for index in (0, 1):
        s = tasks.make_sample(task, tok, length, index, seed=3)
        assert 0.98 * length <= s.n_tokens <= length, (task, length, s.n_tokens)
        assert 0 < s.question_start < s.n_tokens
        ctx = tok.decode(list(s.input_ids[: s.question_start]))
        question = tok.decode(list(s.input_ids[s.question_start:]))
        assert ctx == s.context_text
        assert question == s.question_text
        if not task.startswith("tf_"):
            # The chat template wraps the task: the assistant turn opens before the answer prefix.
            assert s.question_text.rstrip().endswith(s.answer_prefix.strip())
            assert "<|im_start|>assistant" in s.question_text
            assert "<|im_start|>user" in s.context_text


@pytest.mark.parametrize("task", SCORED)
def test_perfect_answer_scores_one_and_wrong_scores_zero(tok, task):
    s = tasks.make_sample(task, tok, 512, 0)
    assert s.score(" " + ", ".join(s.gold) + ".") == 1.0
    assert s.score(s.target) == 1.0
    assert s.score("I do not know.") == 0.0
    assert s.score("") == 0.0
    if s.metric == "all" and len(s.gold) > 1:
        assert s.score(s.gold[0]) == pytest.approx(1 / len(s.gold))


def test_tf_tasks_have_no_score(tok):
    s = tasks.make_sample("tf_essay", tok, 512, 0)
    assert s.max_new_tokens == 0 and s.score("anything") is None
    assert s.n_tokens - s.question_start == tasks.tf.CONTINUATION_TOKENS
    g = tasks.make_sample("tf_gsm8k", tok, 2048, 0)
    assert g.max_new_tokens == 0 and g.score("anything") is None and g.target
    assert g.question_text.startswith("\n\nQuestion:") and g.question_text.endswith("Answer:")
    assert g.context_text.count("Question:") >= 5 and g.info["filler_words"] > 100
    short = tasks.make_sample("tf_gsm8k", tok, 512, 0)
    assert short.info["shots"] < g.info["shots"] and short.n_tokens <= 512


@pytest.mark.parametrize("task", [t for t in SCORED if t.startswith("niah")])
def test_needles_in_context_and_answers_only_there(tok, task):
    s = tasks.make_sample(task, tok, 1024, 2)
    for needle in s.info["needles"]:
        assert s.context_text.count(needle) == 1
    for value in s.gold:
        assert s.context_text.count(value) == 1, value
        assert value not in s.question_text
    cfg = niah.CONFIGS[task]
    assert len(s.gold) == cfg.num_values * cfg.num_queries


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.35, 0.5, 0.8, 1.0])
def test_needle_at_requested_depth(tok, task, depth):
    length = 1024
    s = tasks.make_sample(task, tok, length, 0, depth=depth)
    needle = s.info["needles"][0]
    text = s.prompt_text
    intro = "afterwards.\n"
    start = text.index(intro) + len(intro)
    end = text.index("\nWhat are all the special magic")
    pos = text.index(needle)
    haystack_tokens = ntok(tok, text[start:end]) - ntok(tok, needle)
    measured = (ntok(tok, text[start:pos])) / haystack_tokens
    # Needles sit at sentence (or needle) boundaries, which are at most a few dozen tokens apart.
    assert abs(measured - depth) <= 0.04, (measured, depth)


def test_depths_vary_over_samples_when_not_given(tok):
    depths = {tuple(tasks.make_sample("niah_single_2", tok, 512, i).info["depths"]) for i in range(8)}
    assert len(depths) > 3


def test_samples_are_deterministic_and_distinct(tok):
    a = tasks.make_sample("niah_single_2", tok, 512, 4, seed=1)
    b = tasks.make_sample("niah_single_2", tok, 512, 4, seed=1)
    c = tasks.make_sample("niah_single_2", tok, 512, 5, seed=1)
    d = tasks.make_sample("niah_single_2", tok, 512, 4, seed=2)
    assert a.fingerprint() == b.fingerprint()
    assert len({a.fingerprint(), c.fingerprint(), d.fingerprint()}) == 3


def test_vt_chain_is_in_context_in_order(tok):
    s = tasks.make_sample("vt", tok, 1024, 1)
    positions = [s.context_text.index(stmt) for stmt in s.info["statements"]]
    assert positions == sorted(positions)
    value = re.search(r"= (\d{5})\.", s.info["statements"][0]).group(1)
    assert f"assigned the value {value}" in s.question_text
    assert len(s.gold) == 5


def test_cwe_answers_are_the_most_common_words(tok):
    s = tasks.make_sample("cwe", tok, 1024, 0)
    listed = re.findall(r"\d+\. ([a-z]+)", s.context_text.split("afterwards")[-1])
    counts = Counter(listed)
    top = [w for w, _ in counts.most_common(len(s.gold))]
    assert set(top) == set(s.gold)
    assert min(counts[w] for w in s.gold) > max(c for w, c in counts.items() if w not in s.gold)


def test_fwe_answers_are_the_three_most_frequent_coded_words(tok):
    s = tasks.make_sample("fwe", tok, 1024, 0)
    body = s.context_text.split("three most frequently appeared coded words. ")[1]
    counts = Counter(w for w in body.split() if re.fullmatch(f"[a-z]{{{fwe.WORD_LEN}}}", w))
    top3 = [w for w, _ in counts.most_common(3)]
    assert top3 == list(s.gold)


def test_qa_gold_paragraph_among_distractors(tok):
    s = tasks.make_sample("qa_1", tok, 2048, 0)
    assert s.context_text.count(s.info["gold_paragraph"]) == 1
    assert s.info["distractors"] >= 3
    assert s.info["question"] in s.question_text
    assert any(a.lower() in s.info["gold_paragraph"].lower() for a in s.gold)


def test_bad_task_and_length(tok):
    with pytest.raises(ValueError, match="unknown task 'niah_single_9'.*Valid tasks: niah_single_1"):
        tasks.make_sample("niah_single_9", tok, 512, 0)
    with pytest.raises(ValueError, match="length"):
        tasks.make_sample("niah_single_2", tok, 32, 0)
    with pytest.raises(ValueError, match="too short"):
        tasks.make_sample("qa_1", tok, 100, 0)
    with pytest.raises(ValueError, match="depth"):
        tasks.make_sample("niah_single_2", tok, 512, 0, depth=1.5)
