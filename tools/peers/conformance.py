"""Conformance of ``tieredkv serve`` against vLLM's OpenAI server: the same requests to both,
the same answers expected.

Every case is one OpenAI request (completions and chat; streamed and not; stop strings,
``max_tokens``, ``echo``, batches, token-id prompts, ``ignore_eos``, seeds, ``n``, errors),
sent to both servers, which load the same Hugging Face checkpoint (``harness.py``). Greedy
cases must give the same text, the same generated token ids (``return_token_ids``), the same
finish reasons and the same usage counts. A streamed answer must also equal, on each server,
the same request answered in one piece, and a seeded sample must repeat on each server.

Where the two differ, :func:`explain` names the cause when it is a known, understood
difference (the two documented choices that differ, the two servers' own error type names,
their different samplers); anything else is ``unexplained`` and the check fails.

    python tools/peers/conformance.py [--ci] [--out results/peers]       # starts both servers
    python tools/peers/conformance.py --urls http://127.0.0.1:A http://127.0.0.1:B   # servers already up
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

EOS_NOTE = ("vLLM counts the end-of-sequence token in `completion_tokens` and returns it in `token_ids`; "
            "tieredkv counts and returns only the tokens before it (docs/openai-server.md). Reported to the lead.")
NOTES = {
    "eos-counted": EOS_NOTE,
    "default-max-tokens": ("no `max_tokens`: vLLM's /v1/completions default is 16 tokens (OpenAI's legacy default); "
                           "tieredkv's is the rest of the served length (docs/openai-server.md). Reported to the lead."),
    "error-type": ("same status; the error `type` differs: tieredkv answers OpenAI's names (`invalid_request_error`), "
                   "vLLM its exception class names (`BadRequestError`, `NotFoundError`)"),
    "sampler": ("sampled (temperature > 0) with the same seed: each server repeats itself, but the two draw from "
                "different random generators, so their samples differ; compared within each server only"),
    "n>1": "`n` > 1: vLLM returns n choices; tieredkv refuses n != 1 with 400 (docs/openai-server.md)",
}


# ------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """One request. ``sampled``: temperature > 0 (compared within each server, not across);
    ``ci``: part of the CI-sized subset."""

    name: str
    endpoint: str  # "completions" or "chat/completions"
    body: dict[str, Any]
    what: str
    sampled: bool = False
    ci: bool = False


def essay_passage(tokenizer, start: int, length: int) -> str:
    """``length`` tokens of the Paul Graham essays from token ``start``, as text."""
    from tieredkv.runtime.eval.data import pg_essays_text

    ids = tokenizer.encode(pg_essays_text(), add_bos=False)
    return tokenizer.decode(ids[start:start + length])


def cases(tokenizer) -> list[Case]:
    essay = essay_passage(tokenizer, 20000, 500)
    doc = essay_passage(tokenizer, 60000, 400)
    chat_raw = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True)
    short = "The capital of France is"
    g = {"temperature": 0, "return_token_ids": True}
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    return [
        Case("cmpl-short", "completions", {"prompt": short, "max_tokens": 24, **g}, "short prompt, 24 tokens"),
        Case("cmpl-essay", "completions", {"prompt": essay, "max_tokens": 64, **g}, "500-token essay, 64 tokens",
             ci=True),
        Case("cmpl-essay-stream", "completions",
             {"prompt": essay, "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}, **g},
             "the same, streamed, usage chunk", ci=True),
        Case("cmpl-stop", "completions", {"prompt": short, "max_tokens": 30, "stop": ["\n"], **g},
             "stop string `\\n`"),
        Case("cmpl-stop-list-stream", "completions",
             {"prompt": essay, "max_tokens": 64, "stop": [" the ", "."], "stream": True,
              "stream_options": {"include_usage": True}, **g}, "two stop strings, streamed", ci=True),
        Case("cmpl-batch", "completions",
             {"prompt": [short, "Once upon a time", "def fibonacci(n):"], "max_tokens": 16, **g},
             "three prompts in one request"),
        Case("cmpl-token-ids", "completions",
             {"prompt": tokenizer.encode("Water is essential for", add_bos=False), "max_tokens": 16, **g},
             "prompt as token ids"),
        Case("cmpl-echo", "completions", {"prompt": short, "max_tokens": 8, "echo": True, "temperature": 0},
             "echo the prompt"),
        Case("cmpl-max1", "completions", {"prompt": essay, "max_tokens": 1, **g}, "max_tokens 1"),
        Case("cmpl-eos", "completions", {"prompt": chat_raw, "max_tokens": 64, **g},
             "ends on the end-of-sequence token", ci=True),
        Case("cmpl-ignore-eos", "completions", {"prompt": chat_raw, "max_tokens": 24, "ignore_eos": True, **g},
             "ignore_eos past the end token"),
        Case("cmpl-top-k-1", "completions",
             {"prompt": short, "max_tokens": 24, "temperature": 1.0, "top_k": 1, "return_token_ids": True},
             "temperature 1, top_k 1 (greedy)"),
        Case("cmpl-default-max-tokens", "completions", {"prompt": short, "temperature": 0},
             "no max_tokens"),
        Case("cmpl-unicode-stream", "completions",
             {"prompt": "Écris une phrase sur le café ☕ et les crêpes:", "max_tokens": 32, "stream": True, **g},
             "accents and emoji, streamed"),
        Case("chat-basic", "chat/completions", {"messages": user("Hi!"), "max_tokens": 40, **g},
             "one user message (default system prompt)", ci=True),
        Case("chat-default-max-tokens", "chat/completions", {"messages": user("Hi!"), "temperature": 0},
             "no max_tokens (ends on the end token)"),
        Case("chat-system", "chat/completions",
             {"messages": [{"role": "system", "content": "You answer in one short sentence."},
                           {"role": "user", "content": "What is the boiling point of water?"}],
              "max_tokens": 48, **g}, "system + user"),
        Case("chat-multi-turn", "chat/completions",
             {"messages": [{"role": "user", "content": "Name a fruit."},
                           {"role": "assistant", "content": "An apple."},
                           {"role": "user", "content": "What color is it?"}], "max_tokens": 48, **g},
             "user / assistant / user"),
        Case("chat-stream", "chat/completions",
             {"messages": user("Write a haiku about the sea."), "max_tokens": 48, "stream": True,
              "stream_options": {"include_usage": True}, **g}, "streamed, usage chunk", ci=True),
        Case("chat-stop", "chat/completions", {"messages": user("Hi!"), "max_tokens": 40, "stop": ["!"], **g},
             "stop string `!`"),
        Case("chat-max-completion-tokens", "chat/completions",
             {"messages": user("Tell me about Paris."), "max_completion_tokens": 12, **g},
             "max_completion_tokens 12"),
        Case("chat-content-parts", "chat/completions",
             {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi!"},
                                                        {"type": "text", "text": "Who are you?"}]}],
              "max_tokens": 30, **g}, "content as text parts"),
        Case("chat-long", "chat/completions",
             {"messages": user(doc + "\n\nSummarize the text above in one sentence."), "max_tokens": 48, **g},
             "400-token document + question"),
        Case("cmpl-seed", "completions",
             {"prompt": short, "max_tokens": 24, "temperature": 0.8, "seed": 1234}, "temperature 0.8, seed",
             sampled=True),
        Case("chat-seed-top-p", "chat/completions",
             {"messages": user("Tell me a story."), "max_tokens": 24, "temperature": 0.7, "top_p": 0.9,
              "seed": 99}, "temperature 0.7, top_p 0.9, seed", sampled=True),
        Case("cmpl-n2", "completions",
             {"prompt": short, "max_tokens": 8, "temperature": 0.8, "seed": 7, "n": 2}, "n 2 (sampled)",
             sampled=True),
        Case("err-context", "completions", {"prompt": short, "max_tokens": 9000, "temperature": 0},
             "prompt + max_tokens over the served length"),
        Case("err-model", "completions", {"model": "no-such-model", "prompt": short, "max_tokens": 4},
             "unknown model"),
        Case("err-temperature", "completions", {"prompt": short, "max_tokens": 4, "temperature": -1},
             "temperature -1"),
    ]


# ------------------------------------------------------------------------------ one answer
@dataclass
class Answer:
    """A server's answer, normalized: per choice text / finish reason / token ids, and usage."""

    status: int
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    token_ids: list[list[int] | None] = field(default_factory=list)
    usage: dict[str, int] | None = None
    error_type: str | None = None
    stream_ok: bool | None = None  # a stream ended with [DONE], chat's first delta had the role


def _usage(u: dict | None) -> dict[str, int] | None:
    return None if u is None else {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def ask(client: httpx.Client, base: str, case: Case, model: str) -> Answer:
    body = {"model": model, **case.body}
    url = f"{base}/v1/{case.endpoint}"
    chat = case.endpoint.startswith("chat")
    if not body.get("stream"):
        r = client.post(url, json=body)
        data = r.json()
        if r.status_code != 200:
            return Answer(r.status_code, error_type=(data.get("error") or {}).get("type"))
        choices = sorted(data["choices"], key=lambda c: c["index"])
        return Answer(200, [c["message"]["content"] if chat else c["text"] for c in choices],
                      [c["finish_reason"] for c in choices], [c.get("token_ids") for c in choices],
                      _usage(data.get("usage")))
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage, done, role_first = None, False, not chat
    with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            data = json.loads(r.read())
            return Answer(r.status_code, error_type=(data.get("error") or {}).get("type"))
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for c in chunk.get("choices") or []:
                i = c["index"]
                if chat:
                    delta = c.get("delta") or {}
                    if i not in texts and delta.get("role") == "assistant":
                        role_first = True
                    piece = delta.get("content") or ""
                else:
                    piece = c.get("text") or ""
                texts[i] = texts.get(i, "") + piece
                if c.get("finish_reason") is not None:
                    finish[i] = c["finish_reason"]
    order = sorted(texts)
    return Answer(200, [texts[i] for i in order], [finish.get(i) for i in order], [None] * len(order), usage,
                  stream_ok=done and role_first)


# ------------------------------------------------------------------------------ comparison
@dataclass
class Row:
    case: str
    what: str
    field: str
    tieredkv: Any
    vllm: Any
    verdict: str  # "same", "explained: <key>", "unexplained", "self-check failed"


def explain(case: Case, fld: str, a: Answer, b: Answer) -> str | None:
    """The known cause of a difference between tieredkv's answer ``a`` and vLLM's ``b``, or None."""
    if fld == "status":
        if case.body.get("n", 1) > 1 and a.status == 400 and b.status == 200:
            return "n>1"
        return None
    if fld == "error_type":
        return "error-type"
    if case.sampled and fld in ("text", "token_ids", "finish_reason", "completion_tokens", "total_tokens"):
        return "sampler"
    if "max_tokens" not in case.body and "max_completion_tokens" not in case.body and a.status == b.status == 200:
        if b.usage and b.usage["completion_tokens"] == 16 and b.finish == ["length"]:
            return "default-max-tokens"
    if fld in ("completion_tokens", "total_tokens", "token_ids") and _eos_counted(a, b):
        return "eos-counted"
    return None


def _eos_counted(a: Answer, b: Answer) -> bool:
    """The same text and finish reasons, and vLLM's counts (and token ids) are tieredkv's plus
    one token for some of the choices that ended with ``stop``: the end-of-sequence token."""
    if a.texts != b.texts or a.finish != b.finish or not a.usage or not b.usage:
        return False
    extra = b.usage["completion_tokens"] - a.usage["completion_tokens"]
    if not 1 <= extra <= sum(f == "stop" for f in a.finish):
        return False
    if any(t is None for t in a.token_ids + b.token_ids):
        return True
    return all(y == x or (f == "stop" and y[:-1] == x) for x, y, f in zip(a.token_ids, b.token_ids, a.finish))


def compare(case: Case, a: Answer, b: Answer) -> list[Row]:
    """Rows for one case: tieredkv's answer ``a`` against vLLM's ``b``, field by field."""
    pairs: list[tuple[str, Any, Any]] = [("status", a.status, b.status)]
    if a.status == b.status != 200:
        pairs.append(("error_type", a.error_type, b.error_type))
    elif a.status == b.status == 200:
        pairs += [("text", a.texts, b.texts), ("finish_reason", a.finish, b.finish)]
        if any(t is not None for t in a.token_ids) and any(t is not None for t in b.token_ids):
            pairs.append(("token_ids", a.token_ids, b.token_ids))
        if a.usage is not None or b.usage is not None:
            for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
                pairs.append((k, (a.usage or {}).get(k), (b.usage or {}).get(k)))
    rows = []
    for fld, x, y in pairs:
        if x == y:
            rows.append(Row(case.name, case.what, fld, x, y, "same"))
            continue
        key = explain(case, fld, a, b)
        rows.append(Row(case.name, case.what, fld, x, y, f"explained: {key}" if key else "unexplained"))
    return rows


def self_checks(case: Case, server: str, first: Answer, again: Answer | None, plain: Answer | None) -> list[Row]:
    """Checks of one server against itself: a seeded sample repeats; a stream ends with [DONE]
    and says the same as the request answered in one piece."""
    rows = []
    if again is not None:
        same = (first.texts, first.usage) == (again.texts, again.usage)
        rows.append(Row(case.name, case.what, f"{server}: same seed twice", first.texts, again.texts,
                        "same" if same else "self-check failed"))
    if plain is not None:
        same = first.stream_ok and (first.texts, first.finish, first.usage) == (
            plain.texts, plain.finish, plain.usage if first.usage is not None else None)
        rows.append(Row(case.name, case.what, f"{server}: stream = one piece", first.texts, plain.texts,
                        "same" if same else "self-check failed"))
    return rows


def run(urls: dict[str, str], model: str, suite: list[Case], *, log=harness._log) -> list[Row]:
    """Every case against both servers (``urls``: ``tieredkv`` and ``vllm``)."""
    rows: list[Row] = []
    with httpx.Client(timeout=600) as client:
        for case in suite:
            got = {name: ask(client, url, case, model) for name, url in urls.items()}
            rows += compare(case, got["tieredkv"], got["vllm"])
            for name, url in urls.items():
                if got[name].status != 200:
                    continue
                again = ask(client, url, case, model) if case.sampled else None
                plain = None
                if case.body.get("stream"):
                    body = {k: v for k, v in case.body.items() if k not in ("stream", "stream_options")}
                    plain = ask(client, url, Case(case.name, case.endpoint, body, case.what), model)
                    plain.token_ids = [None] * len(plain.texts)
                rows += self_checks(case, name, got[name], again, plain)
            verdicts = {r.verdict for r in rows if r.case == case.name}
            log(f"  {case.name}: {', '.join(sorted(verdicts))}")
    return rows


# ------------------------------------------------------------------------------ report
def _cell(v: Any, width: int = 60) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v
    s = s.replace("|", "\\|").replace("\n", "\\n")
    return s if len(s) <= width else s[:width - 1] + "…"


def markdown(rows: list[Row], suite: list[Case]) -> str:
    """One line per case (what was identical), then every difference with its explanation."""
    out = ["| case | request | identical | differs |", "|---|---|---|---|"]
    for case in suite:
        mine = [r for r in rows if r.case == case.name]
        same = [r.field for r in mine if r.verdict == "same"]
        diff = [f"{r.field} ({r.verdict.removeprefix('explained: ')})" for r in mine if r.verdict != "same"]
        out.append(f"| {case.name} | {case.what} | {', '.join(same) or '-'} | {', '.join(diff) or '-'} |")
    diffs = [r for r in rows if r.verdict != "same"]
    if diffs:
        out += ["", "| case | field | tieredkv | vLLM | verdict |", "|---|---|---|---|---|"]
        out += [f"| {r.case} | {r.field} | {_cell(r.tieredkv)} | {_cell(r.vllm)} | {r.verdict} |" for r in diffs]
    keys = sorted({r.verdict.removeprefix("explained: ") for r in diffs if r.verdict.startswith("explained")})
    if keys:
        out += [""] + [f"- **{k}**: {NOTES[k]}" for k in keys]
    return "\n".join(out)


def summary(rows: list[Row]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        key = "explained" if r.verdict.startswith("explained") else r.verdict
        out[key] = out.get(key, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ci", action="store_true", help="only the CI-sized subset of the cases")
    ap.add_argument("--urls", nargs=2, metavar=("TIEREDKV", "VLLM"), help="servers already running (base URLs)")
    ap.add_argument("--model-name", default=harness.SERVED_NAME, help="the served model name (with --urls)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each server")
    ap.add_argument("--out", type=Path, default=Path("results/peers"))
    args = ap.parse_args(argv)
    from tieredkv.models.tokenizer import Tokenizer

    root = harness.peers_dir()
    try:
        checkpoint = harness.write_checkpoint(root)
        suite = [c for c in cases(Tokenizer.from_hf_dir(checkpoint)) if c.ci or not args.ci]
        if args.urls:
            rows = run(dict(zip(("tieredkv", "vllm"), args.urls)), args.model_name, suite)
        else:
            peer = harness.find_peer()
            cfg = harness.ServeConfig(threads=args.threads)
            logs = root / "logs"
            with harness.start_tieredkv(checkpoint, cfg, logs) as tkv, \
                    harness.start_vllm(peer, checkpoint, cfg, logs) as vllm:
                rows = run({"tieredkv": tkv.url, "vllm": vllm.url}, cfg.served_name, suite)
    except harness.PeerUnavailable as exc:
        print(f"SKIP: {exc}", file=sys.stderr)
        return harness.EXIT_SKIP
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, suite)
    (args.out / "conformance.md").write_text(table + "\n")
    (args.out / "conformance.json").write_text(json.dumps([asdict(r) for r in rows], indent=1, ensure_ascii=False))
    counts = summary(rows)
    print(table)
    print(f"\n{len(suite)} cases, {len(rows)} checks: {counts} (wrote {args.out / 'conformance.md'})")
    return 1 if counts.get("unexplained") or counts.get("self-check failed") else 0


if __name__ == "__main__":
    sys.exit(main())
