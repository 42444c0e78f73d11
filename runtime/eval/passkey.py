"""Passkey retrieval synthesized from real text.

A random 5-digit key is hidden in a haystack of real text (default: the Paul Graham
essays) at evenly spread depths. The context (instruction + haystack with the needle)
goes to ``method.open`` — compressed before the question is seen (question-agnostic) —
then the question is asked. Two scores per trial:

* exact match: the first number in the greedy answer equals the key;
* the teacher-forced log-probability (nats, summed over the answer's tokens) of the key
  after the question. It moves smoothly where exact match is all-or-nothing.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

from tqdm.auto import tqdm

from tieredkv.errors import ConfigError
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.runtime.eval.harness import EvalMethod

INSTRUCTION = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER = " {key}"


@dataclass
class PasskeyPrompt:
    context: list[int]
    question: list[int]
    answer: list[int]
    key: str
    depth: float
    needle_at: int  # token index of the needle inside context


@dataclass
class PasskeyTrial:
    depth: float
    key: str
    answer: str
    correct: bool
    logprob: float


@dataclass
class PasskeyResult:
    method: dict
    context: int
    trials: int
    accuracy: float
    mean_logprob: float
    seconds: float
    results: list[PasskeyTrial] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _answer_ids(tokenizer: Tokenizer, question: list[int], key: str) -> list[int]:
    joint = tokenizer.encode(QUESTION + ANSWER.format(key=key), add_bos=False)
    if joint[: len(question)] == question:
        return joint[len(question):]
    return tokenizer.encode(ANSWER.format(key=key), add_bos=False)


def build_prompt(tokenizer: Tokenizer, haystack: Sequence[int], *, context: int, depth: float, key: str,
                 offset: int) -> PasskeyPrompt:
    """A prompt of exactly ``context`` tokens (context + question), needle at ``depth``."""
    prefix = tokenizer.encode(INSTRUCTION)
    needle = tokenizer.encode(NEEDLE.format(key=key), add_bos=False)
    question = tokenizer.encode(QUESTION, add_bos=False)
    filler_len = context - len(prefix) - len(needle) - len(question)
    if filler_len < 16:
        raise ConfigError(f"--context {context} is too short for a passkey prompt; expected at least "
                          f"{len(prefix) + len(needle) + len(question) + 16} tokens")
    if len(haystack) < filler_len:
        raise ConfigError(f"the haystack has {len(haystack)} tokens; --context {context} needs {filler_len}")
    offset %= len(haystack) - filler_len + 1
    filler = list(haystack[offset : offset + filler_len])
    pos = int(round(depth * filler_len))
    # move forward to a sentence boundary when one is near, so the needle reads as a sentence
    for j in range(pos, min(pos + 64, filler_len)):
        if j > 0 and tokenizer.decode([filler[j - 1]]).rstrip(" ").endswith((".", "\n", "?", "!")):
            pos = j
            break
    ctx = prefix + filler[:pos] + needle + filler[pos:]
    return PasskeyPrompt(ctx, question, _answer_ids(tokenizer, question, key), key, depth, len(prefix) + pos)


def depths(trials: int) -> list[float]:
    if trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {trials}")
    return [0.5] if trials == 1 else [i / (trials - 1) for i in range(trials)]


def trial_prompts(tokenizer: Tokenizer, haystack: Sequence[int], *, context: int, trials: int,
                  seed: int = 0) -> Iterator[PasskeyPrompt]:
    """The prompts of ``trials`` trials, in order: ``seed`` draws each trial's key, then its
    haystack offset (so trial i is the same whatever is measured on it)."""
    rng = random.Random(seed)
    for depth in depths(trials):
        key = str(rng.randint(10000, 99999))
        yield build_prompt(tokenizer, haystack, context=context, depth=depth, key=key, offset=rng.randrange(1 << 30))


def run_trial(method: EvalMethod, tokenizer: Tokenizer, prompt: PasskeyPrompt, *, context: int) -> PasskeyTrial:
    """One trial: open the (compressed) context, score the key teacher-forced, then answer greedily
    (the answer's tokens and 4 more: all must fit the model's context)."""
    total = context + len(prompt.answer) + 4
    method.check_length(total, f"--context {context} plus the answer ({len(prompt.answer) + 4} tokens)")
    session = method.open(prompt.context, total_tokens=total)
    try:
        lp = session.logprobs(prompt.question + prompt.answer)[len(prompt.question):]
        gen = session.greedy(prompt.question, max_new_tokens=len(prompt.answer) + 4)
    finally:
        session.close()
    answer = tokenizer.decode(gen)
    found = re.search(r"\d+", answer)
    return PasskeyTrial(prompt.depth, prompt.key, answer, bool(found and found.group() == prompt.key),
                        float(lp.sum()))


def passkey(method: EvalMethod, tokenizer: Tokenizer, haystack: Sequence[int], *, context: int, trials: int,
            seed: int = 0, progress: bool = True) -> PasskeyResult:
    t_start = time.perf_counter()
    results = []
    bar = tqdm(trial_prompts(tokenizer, haystack, context=context, trials=trials, seed=seed), total=trials,
               desc=f"passkey[{method.name}]@{context}", unit="trial", disable=not progress, leave=False)
    for prompt in bar:
        results.append(run_trial(method, tokenizer, prompt, context=context))
        bar.set_postfix(acc=f"{sum(r.correct for r in results)}/{len(results)}")
    return PasskeyResult(
        method=method.describe(), context=context, trials=trials,
        accuracy=sum(r.correct for r in results) / len(results),
        mean_logprob=sum(r.logprob for r in results) / len(results),
        seconds=time.perf_counter() - t_start, results=results, stats=method.stats(),
    )
