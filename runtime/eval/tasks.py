"""RULER-style synthetic retrieval tasks over any haystack, generated locally and seeded.

Every task builds prompts of exactly ``context`` tokens (context + question) from a
haystack of real text, with its needles at requested depths, and is scored like
:mod:`tieredkv.runtime.eval.passkey`: the context goes to ``method.open`` (compressed
before the question is seen: question-agnostic), then

* exact match: the greedy answer's first items (numbers, or variable names) are the
  expected ones (any order for several);
* recall: the share of the expected items found anywhere in the greedy answer;
* the teacher-forced log-probability (nats, summed over the answer's tokens) of the
  reference answer after the question.

Tasks (:data:`TASKS`): ``passkey`` (passkey.py's needle, asked for the key hidden in the
text), ``multikey`` (several key-value needles, one asked), ``multivalue`` (one key with
several values, all asked), ``multiquery`` (several needles asked at once), ``numbers`` (a
number stated in a plain sentence, among sentences of the same kind about other places),
``vartrack`` (a chain ``VAR A = 12345 ... VAR B = VAR A ...``; which variables hold the
value?). Their sizes (needles, values, hops) are those SmolLM2-135M's full cache answers
(docs/eval-suite.md has the measurements).

Robust to distracting haystacks: :func:`sanitize_haystack` drops every digit from the
haystack, so the only numbers in a prompt are the needles' (5-digit, distinct); keys,
places and variable names are drawn among those absent from the haystack window; the
passkey's question points at the text and its answer prefix repeats the needle's words;
each task has the framing (plain text, or one chat turn: :class:`Frame`) that the full
cache answered best. The trial with index ``i`` draws everything from
``Random(f"{task}/{seed}/{i}")``: the same trial whatever else is measured.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

from tqdm.auto import tqdm

from tieredkv.errors import ConfigError
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.eval import passkey as _passkey
from tieredkv.runtime.eval.harness import EvalMethod

MAGIC_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
                     "them. I will quiz you about the numbers afterwards.\n\n")
MAGIC_NEEDLE = "\nOne of the special magic numbers for {key} is: {value}.\n"
READ_INSTRUCTION = "Read the following text carefully. I will ask you a question about it afterwards.\n\n"
VAR_INSTRUCTION = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"

ADJECTIVES = ("amber", "brisk", "cobalt", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly", "lunar",
              "mellow", "nimble", "olive", "plush", "quiet", "rusty", "silver", "tidy", "vivid", "wooden", "zesty")
NOUNS = ("anchor", "badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island", "jungle",
         "kettle", "lantern", "meadow", "nectar", "orchard", "pebble", "quarry", "river", "saddle", "tunnel",
         "violin", "walnut")
PLACES = ("Ashcombe", "Brackenridge", "Coldharbour", "Dunmere", "Elderwick", "Fernhollow", "Glenrowan",
          "Hartsfield", "Ivybridge", "Kestrel Bay", "Lowthorpe", "Marshwood", "Northcliffe", "Oakhaven",
          "Pendlebury", "Ravenglass", "Stonebridge", "Thornbury", "Upwater", "Westmarch")
#: (needle sentence, question, answer prefix) of the ``numbers`` task
FACTS = (
    ("In its first year, the lighthouse museum of {place} welcomed exactly {value} visitors.",
     "How many visitors did the lighthouse museum of {place} welcome in its first year?",
     "The lighthouse museum of {place} welcomed exactly"),
    ("The old stone bridge at {place} was rebuilt with exactly {value} new bricks.",
     "How many new bricks were used to rebuild the old stone bridge at {place}?",
     "The old stone bridge at {place} was rebuilt with exactly"),
    ("Last winter the public library of {place} lent out exactly {value} books.",
     "How many books did the public library of {place} lend out last winter?",
     "Last winter the public library of {place} lent out exactly"),
    ("The orchard cooperative of {place} harvested exactly {value} apples this autumn.",
     "How many apples did the orchard cooperative of {place} harvest this autumn?",
     "The orchard cooperative of {place} harvested exactly"),
)
_COUNTS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_DIGITS = re.compile(r"\d+(?:[.,:/-]\d+)*")
_NUMBER = re.compile(r"\b\d{5}\b")
_NAME = re.compile(r"\b[A-Z]{5}\b")


def sanitize_haystack(text: str) -> str:
    """``text`` without digits: numbers (with their inner separators, ``1,030`` or ``1992-98``)
    are removed and the spaces they leave collapsed, so the needles' numbers are the only ones."""
    return re.sub(r"(?<=\S) {2,}(?=\S)", " ", _DIGITS.sub("", text))


@dataclass
class TaskPrompt:
    task: str
    context: list[int]
    question: list[int]
    answer: list[int]  # reference answer tokens, scored teacher-forced after the question
    expected: list[str]  # items the greedy answer must give
    depth: float  # the trial's depth (of the first asked needle)
    needle_depths: list[float]  # every needle's requested depth, in insertion order
    needle_at: list[int]  # token index of every needle inside context, same order
    needle_lens: list[int]  # tokens of every needle, same order
    prefix_len: int  # tokens before the filler (frame head + instruction)

    @property
    def length(self) -> int:
        return len(self.context) + len(self.question)


@dataclass
class TaskTrial:
    depth: float
    expected: list[str]
    answer: str
    correct: bool
    recall: float
    logprob: float


@dataclass
class TaskResult:
    task: str
    method: dict
    context: int
    trials: int
    accuracy: float
    recall: float
    mean_logprob: float
    seconds: float
    results: list[TaskTrial] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------ composing prompts
def _boundary(tokenizer: Tokenizer, filler: Sequence[int], pos: int) -> int:
    """``pos``, moved forward to a sentence end when one is within 64 tokens (passkey.py's rule)."""
    for j in range(pos, min(pos + 64, len(filler))):
        if j > 0 and tokenizer.decode([filler[j - 1]]).rstrip(" ").endswith((".", "\n", "?", "!")):
            return j
    return pos


def compose(tokenizer: Tokenizer, filler: Sequence[int], prefix: list[int],
            needles: Sequence[tuple[float, list[int]]]) -> tuple[list[int], list[int]]:
    """``prefix`` + ``filler`` with each ``(depth, tokens)`` needle inserted at ``depth`` of the
    filler (at a sentence end when one is near). Needles keep their given order where depths
    are equal or increasing. Returns the context and each needle's token index in it."""
    positions = [_boundary(tokenizer, filler, int(round(depth * len(filler)))) for depth, _ in needles]
    ctx, at, cut = list(prefix), [0] * len(needles), 0
    for i in sorted(range(len(needles)), key=lambda i: (positions[i], i)):  # the boundary rule keeps depth order
        ctx += filler[cut : positions[i]]
        at[i] = len(ctx)
        ctx += needles[i][1]
        cut = positions[i]
    ctx += filler[cut:]
    return ctx, at


def _answer_ids(tokenizer: Tokenizer, question_text: str, question: list[int], answer_text: str) -> list[int]:
    joint = tokenizer.encode(question_text + answer_text, add_bos=False)
    if joint[: len(question)] == question:
        return joint[len(question):]
    return tokenizer.encode(answer_text, add_bos=False)


@dataclass(frozen=True)
class Frame:
    """What surrounds a prompt: ``head`` before the instruction, ``tail`` between the question
    and the answer prefix. ``plain``: nothing (as passkey.py); ``chat``: one user turn of the
    model's chat template, the answer prefix opening the assistant's turn."""

    name: str
    head: str = ""
    tail: str = " "


PLAIN = Frame("plain")
#: ``task``: each task's own (:attr:`Task.framing`); the others apply to every task
FRAMINGS = ("task", "plain", "chat", "auto")
_MARK = "\x00QUESTION\x00"


def frame_for(tokenizer: Tokenizer, framing: str = "auto") -> Frame:
    """``auto``: ``chat`` when the tokenizer has a chat template, else ``plain``."""
    if framing not in FRAMINGS or framing == "task":
        raise ConfigError(f"framing must be one of {list(FRAMINGS[1:])}, got {framing!r}")
    if framing == "plain" or (framing == "auto" and not tokenizer.chat_template):
        return PLAIN
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], add_generation_prompt=True)
    if rendered.count(_MARK) != 1:
        raise ConfigError("the model's chat template does not render the user's message verbatim; use framing "
                          "'plain'")
    head, tail = rendered.split(_MARK)
    return Frame("chat", head, tail)


class _Builder:
    """One trial's haystack window and random draws; builds its prompt (shared by the tasks).

    The filler is the start of the window ``haystack[start : start + context]``, whatever
    the needles' lengths, so names can be checked absent from it before the needles exist."""

    def __init__(self, tokenizer: Tokenizer, haystack: Sequence[int], context: int, rng: random.Random,
                 frame: Frame = PLAIN) -> None:
        if len(haystack) < context:
            raise ConfigError(f"the haystack has {len(haystack)} tokens; a context of {context} needs at least "
                              f"{context}")
        self.tok, self.hay, self.context, self.rng, self.frame = tokenizer, haystack, context, rng, frame
        self.start = rng.randrange(len(haystack) - context + 1)
        self.window = tokenizer.decode(list(haystack[self.start : self.start + context]))

    def values(self, n: int) -> list[str]:
        """``n`` distinct 5-digit numbers."""
        out: list[str] = []
        while len(out) < n:
            v = str(self.rng.randint(10000, 99999))
            if v not in out:
                out.append(v)
        return out

    def pick(self, pool: Sequence[str], n: int) -> list[str]:
        """``n`` distinct items of ``pool`` that do not occur in the haystack window."""
        free = [p for p in pool if p.lower() not in self.window.lower()]
        if len(free) < n:
            raise ConfigError(f"the haystack window contains too many of the task's names ({list(pool[:3])}...)")
        return self.rng.sample(free, n)

    def prompt(self, task: str, instruction: str, needles: Sequence[tuple[float, str]], question: str,
               answer_prefix: str, answer_text: str, expected: list[str], depth: float) -> TaskPrompt:
        """``instruction`` + the filler with ``needles`` is the context; then ``question``, the
        frame's tail and ``answer_prefix``; ``answer_text`` is the reference answer."""
        prefix = self.tok.encode(self.frame.head + instruction)
        question_text = "\n\n" + question + self.frame.tail + answer_prefix
        encoded = [(d, self.tok.encode(t, add_bos=False)) for d, t in needles]
        q_ids = self.tok.encode(question_text, add_bos=False)
        used = len(prefix) + sum(len(t) for _, t in encoded) + len(q_ids)
        if self.context - used < 16:
            raise ConfigError(f"a context of {self.context} tokens is too short for a {task} prompt; expected at "
                              f"least {used + 16}")
        filler = list(self.hay[self.start : self.start + self.context - used])
        ctx, at = compose(self.tok, filler, prefix, encoded)
        return TaskPrompt(task, ctx, q_ids, _answer_ids(self.tok, question_text, q_ids, answer_text),
                          expected, depth, [d for d, _ in needles], at, [len(t) for _, t in encoded], len(prefix))


def _random_depths(rng: random.Random, n: int) -> list[float]:
    return [rng.random() for _ in range(n)]


def _list(items: Sequence[str]) -> str:
    return ", ".join(items)


# ------------------------------------------------------------------------------ the tasks
#: the passkey question: pointed at the text (passkey.py's bare "What is the pass key?" invites answers
#: from world knowledge on some haystacks, "a magical key that is used to unlock doors"), its answer
#: prefix the needle's own words (so that the model can copy what follows them)
PASSKEY_QUESTION = ("What is the pass key hidden in the text above?", "The pass key is")


def build_passkey(b: _Builder, depth: float) -> TaskPrompt:
    """passkey.py's instruction and needle, :data:`PASSKEY_QUESTION`."""
    key = b.values(1)[0]
    question, prefix = PASSKEY_QUESTION
    return b.prompt("passkey", _passkey.INSTRUCTION, [(depth, _passkey.NEEDLE.format(key=key))], question, prefix,
                    _passkey.ANSWER.format(key=key), [key], depth)


def _magic(b: _Builder, task: str, depth: float, *, keys: int, values_per_key: int, asked: int) -> TaskPrompt:
    """``keys`` keys with ``values_per_key`` values each; the first ``asked`` keys are asked.
    The first asked needle is at ``depth``, every other needle at a random depth."""
    n = keys * values_per_key
    values = b.values(n)
    depths = [depth] + _random_depths(b.rng, n - 1)
    names = b.pick([f"{a}-{o}" for a in ADJECTIVES for o in NOUNS], keys)
    needles = [(depths[i], MAGIC_NEEDLE.format(key=names[i // values_per_key], value=values[i])) for i in range(n)]
    asked_values = [values[i] for i in range(n) if i // values_per_key < asked]
    if values_per_key > 1:  # several values of one key: expected in the order they appear in the text
        asked_values.sort(key=lambda v: depths[values.index(v)])
    question, prefix = _magic_question(names[:asked], values_per_key)
    return b.prompt(task, MAGIC_INSTRUCTION, needles, question, prefix, " " + _list(asked_values), asked_values,
                    depth)


def _magic_question(keys: Sequence[str], values_per_key: int) -> tuple[str, str]:
    """(question, answer prefix)."""
    if values_per_key > 1:
        k = keys[0]
        return (f"What are all the special magic numbers for {k} mentioned in the provided text?",
                f"The special magic numbers for {k} are")
    if len(keys) == 1:
        k = keys[0]
        return (f"What is the special magic number for {k} mentioned in the provided text?",
                f"The special magic number for {k} is")
    ks = ", ".join(keys[:-1]) + " and " + keys[-1]
    return (f"What are the special magic numbers for {ks} mentioned in the provided text?",
            f"The special magic numbers for {ks} are")


def build_multikey(b: _Builder, depth: float, *, keys: int = 4) -> TaskPrompt:
    return _magic(b, "multikey", depth, keys=keys, values_per_key=1, asked=1)


def build_multivalue(b: _Builder, depth: float, *, values: int = 2) -> TaskPrompt:
    return _magic(b, "multivalue", depth, keys=1, values_per_key=values, asked=1)


def build_multiquery(b: _Builder, depth: float, *, keys: int = 2, asked: int = 2) -> TaskPrompt:
    return _magic(b, "multiquery", depth, keys=keys, values_per_key=1, asked=asked)


def build_numbers(b: _Builder, depth: float, *, distractors: int = 2) -> TaskPrompt:
    """A number stated in a plain sentence, among ``distractors`` sentences of other kinds about
    other places; the sentence asked is at ``depth``."""
    n = distractors + 1
    values = b.values(n)
    facts = b.rng.sample(range(len(FACTS)), n)
    depths = [depth] + _random_depths(b.rng, distractors)
    places = b.pick(PLACES, n)
    needles = [(d, "\n" + FACTS[f][0].format(place=p, value=v) + "\n")
               for d, f, p, v in zip(depths, facts, places, values)]
    _, q, a = FACTS[facts[0]]
    return b.prompt("numbers", READ_INSTRUCTION, needles, q.format(place=places[0]), a.format(place=places[0]),
                    f" {values[0]}", [values[0]], depth)


def build_vartrack(b: _Builder, depth: float, *, hops: int = 2, distractor_chain: bool = True) -> TaskPrompt:
    """``VAR A = 12345.`` then ``VAR B = VAR A.`` ... (``hops`` links, in order after ``depth``),
    and a second chain from another value as a distractor; asks for every variable of the first."""
    value, other = b.values(2)
    names: list[str] = []
    while len(names) < 2 * (hops + 1):  # 5 capitals, not in the window (nor another name's prefix)
        name = "".join(b.rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in names and name not in b.window:
            names.append(name)
    chain, distractor = names[: hops + 1], names[hops + 1 :]

    def links(vars_: list[str], start: str) -> list[str]:
        return [f"\nVAR {vars_[0]} = {start}.\n"] + [f"\nVAR {vars_[i]} = VAR {vars_[i - 1]}.\n"
                                                      for i in range(1, len(vars_))]

    first = sorted([depth] + [depth + (1 - depth) * x for x in _random_depths(b.rng, hops)])
    second = sorted(_random_depths(b.rng, hops + 1))
    needles = list(zip(first, links(chain, value)))
    if distractor_chain:
        needles += list(zip(second, links(distractor, other)))
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain of variable assignments in the text above, {_COUNTS[hops + 1]} "
              f"variables are assigned the value {value}, they are:")
    return b.prompt("vartrack", VAR_INSTRUCTION, needles, question, prefix, " " + " ".join(chain), chain, depth)


@dataclass(frozen=True)
class Task:
    """One synthetic task: ``build(builder, depth)`` makes a trial's prompt; ``items`` finds the
    answer items (numbers, or variable names) in a greedy answer; ``framing``: its prompt's frame
    unless the caller picks one for every task (the one SmolLM2's full cache answered best:
    passkey plain, as passkey.py; the RULER-style tasks as a chat turn where the model has a
    chat template)."""

    name: str
    description: str
    build: Callable[[_Builder, float], TaskPrompt]
    items: re.Pattern = _NUMBER
    framing: str = "auto"


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("passkey", "one 5-digit pass key: passkey.py's needle, asked for what is hidden in the text",
         build_passkey, framing="plain"),
    Task("multikey", "4 magic-number needles under different keys, one asked", build_multikey),
    Task("multivalue", "2 magic numbers under one key, both asked", build_multivalue),
    Task("multiquery", "2 magic-number needles under different keys, both asked at once", build_multiquery),
    Task("numbers", "a number stated in a plain sentence, among 2 such sentences about other places", build_numbers),
    Task("vartrack", "a 2-hop chain of variable assignments (and a distractor chain); all its 3 variables asked",
         build_vartrack, _NAME),
)}


def task_names() -> list[str]:
    return list(TASKS)


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; expected one of {task_names()}") from None


# ------------------------------------------------------------------------------ running
def task_frame(task: str, tokenizer: Tokenizer, framing: str = "task") -> Frame:
    """The frame of ``task``'s prompts: its own (``task``) or ``plain`` / ``chat`` / ``auto``."""
    return frame_for(tokenizer, get_task(task).framing if framing == "task" else framing)


def task_prompts(task: str, tokenizer: Tokenizer, haystack: Sequence[int], *, context: int, trials: int,
                 seed: int = 0, frame: Frame = PLAIN) -> Iterator[TaskPrompt]:
    """The prompts of ``trials`` trials at evenly spread depths (passkey.py's ``depths``)."""
    t = get_task(task)
    for i, depth in enumerate(_passkey.depths(trials)):
        b = _Builder(tokenizer, haystack, context, random.Random(f"{task}/{seed}/{i}"), frame)
        yield t.build(b, depth)


def score_answer(task: str, answer: str, expected: Sequence[str]) -> tuple[bool, float]:
    """(exact match, recall): the answer's first ``len(expected)`` items are the expected ones
    (in any order); recall = the share of expected items anywhere in the answer."""
    found = get_task(task).items.findall(answer)
    correct = sorted(found[: len(expected)]) == sorted(expected)
    return correct, sum(e in found for e in expected) / len(expected)


def run_task_trial(method: EvalMethod, tokenizer: Tokenizer, prompt: TaskPrompt) -> TaskTrial:
    """One trial: open the (compressed) context, score the reference answer teacher-forced,
    then answer greedily (twice the answer's tokens and 24 more: room for a wordier format
    than the reference's; all must fit the model's context)."""
    extra = 2 * len(prompt.answer) + 24
    method.check_length(prompt.length + extra, f"a {prompt.task} prompt of {prompt.length} tokens plus the "
                        f"answer ({extra} tokens)")
    session = method.open(prompt.context, total_tokens=prompt.length + extra)
    try:
        lp = session.logprobs(prompt.question + prompt.answer)[len(prompt.question):]
        gen = session.greedy(prompt.question, max_new_tokens=extra)
    finally:
        session.close()
    answer = tokenizer.decode(gen)
    correct, recall = score_answer(prompt.task, answer, prompt.expected)
    return TaskTrial(prompt.depth, list(prompt.expected), answer, correct, recall, float(lp.sum()))


def run_task(method: EvalMethod, tokenizer: Tokenizer, haystack: Sequence[int], task: str, *, context: int,
             trials: int, seed: int = 0, frame: Frame = PLAIN, progress: bool = True) -> TaskResult:
    t_start = time.perf_counter()
    results: list[TaskTrial] = []
    prompts = task_prompts(task, tokenizer, haystack, context=context, trials=trials, seed=seed, frame=frame)
    bar = tqdm(prompts, total=trials,
               desc=f"{task}[{method.name}]@{context}", unit="trial", disable=not progress, leave=False)
    for prompt in bar:
        results.append(run_task_trial(method, tokenizer, prompt))
        bar.set_postfix(acc=f"{sum(r.correct for r in results)}/{len(results)}")
    n = len(results)
    return TaskResult(task=task, method=method.describe(), context=context, trials=n,
                      accuracy=sum(r.correct for r in results) / n, recall=sum(r.recall for r in results) / n,
                      mean_logprob=sum(r.logprob for r in results) / n, seconds=time.perf_counter() - t_start,
                      results=results, stats=method.stats())
