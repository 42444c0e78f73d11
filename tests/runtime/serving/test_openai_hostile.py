"""The OpenAI-compatible server against hostile clients, on real uvicorn servers (the tiny
random Llama): wrong JSON types refused, not coerced; a body that is not JSON or over the
limit; lone surrogates; prompts too long in characters refused before tokenizing; the event
loop answering /health while prompts are tokenized; and the shutdown contract of ``tieredkv
serve`` with streaming and plain requests in flight (SIGTERM)."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import tiny_model, write_gguf
from servers import ServerThread, start_cli, stop_cli
from tieredkv.runtime.serving.deploy import EngineArgs

MAX_LEN = 512
MODEL = "tiny"
LIMIT = 256 * 1024  # the test server's --max-request-bytes
# the tiny model's float32 pages: the 25 % counts their bytes (8 sequences' T0 must fit)
TIERED = dict(kv={"device_budget": "25%", "budget_reference": "float32"},
              scheduler={"max_model_len": MAX_LEN, "max_num_seqs": 8})
CHAT = [{"role": "user", "content": "Say hi"}]


class CountingTokenizer:
    """The model's tokenizer, counting the characters it was asked to encode."""

    def __init__(self, tok) -> None:
        self.tok, self.chars = tok, 0

    def encode(self, text, **kw):
        self.chars += len(text)
        return self.tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("hostile") / "tiny.gguf", tiny_model(seed=1))


@pytest.fixture(scope="module")
def srv(gguf):
    served = EngineArgs(model=str(gguf), **TIERED).build()
    s = ServerThread(served, tokenizer=CountingTokenizer(served.tokenizer), max_request_bytes=LIMIT)
    yield s
    s.close()


def post(srv, path: str, body, status: int, **headers) -> dict:
    """POST a body (an object is sent as JSON text: lone surrogates escaped) and check the status."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json", **headers},
                   timeout=60)
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    out = r.json()
    if status >= 400:
        assert set(out) == {"error"} and {"message", "type", "param", "code"} <= set(out["error"])
        return out["error"]
    return out


# ------------------------------------------------------------------------------ types and shapes
@pytest.mark.parametrize("field, value", [("max_tokens", "4"), ("max_tokens", True), ("max_tokens", 4.0),
                                          ("stream", "yes"), ("stream", 1), ("temperature", "0.5"),
                                          ("ignore_eos", "true"), ("seed", "7"), ("n", True)])
def test_wrong_json_types_are_refused_not_coerced(srv, field, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    err = post(srv, "/v1/completions", body, 400)
    assert err["param"] == field and err["type"] == "invalid_request_error"


def test_token_id_prompts_of_booleans_and_right_types_that_pass(srv):
    err = post(srv, "/v1/completions", {"prompt": [True, False], "max_tokens": 2}, 400)
    assert err["param"] == "prompt" and "expected one of" in err["message"]
    post(srv, "/v1/completions", {"prompt": [[True, 5]], "max_tokens": 2}, 400)
    # an integer is a valid number; the right types run
    out = post(srv, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "top_p": 1,
                                        "stream": False, "ignore_eos": True}, 200)
    assert out["usage"]["completion_tokens"] == 2


def test_chat_roles_and_parts(srv):
    for role in ("bot", "function", "", "SYSTEM"):
        err = post(srv, "/v1/chat/completions", {"messages": [{"role": role, "content": "hi"}], "max_tokens": 2}, 400)
        assert err["param"] == "messages" and "'system', 'user', 'assistant' or 'tool'" in err["message"]
    err = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400)
    assert err["message"] == "messages[0].content[0]: a text part needs its text (a string in 'text')"
    err = post(srv, "/v1/chat/completions",
               {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400)
    assert "content[1]: only text parts are supported (got a 'image_url' part)" in err["message"]
    for role in ("system", "user", "assistant", "tool"):
        post(srv, "/v1/chat/completions", {"messages": [{"role": role, "content": "hi"}], "max_tokens": 1}, 200)


def test_a_body_that_is_not_json_gets_a_clear_message(srv):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {} if ctype is None else {"content-type": ctype}
        r = httpx.post(srv.url + "/v1/completions", content=body, headers=headers, timeout=30)
        if ctype is None:  # httpx sends no Content-Type for raw content
            assert "content-type" not in r.request.headers
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert "must be JSON sent with 'Content-Type: application/json'" in err["message"]
        assert (ctype or "no Content-Type") in err["message"] and err["code"] == "unsupported_media_type"
    ok = httpx.post(srv.url + "/v1/completions", content=body,
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=30)
    assert ok.status_code == 200


def test_a_body_over_the_limit_is_413(srv):
    huge = json.dumps({"prompt": "a" * (LIMIT + 10), "max_tokens": 2})
    err = post(srv, "/v1/completions", huge, 413)
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]

    def chunks():  # no Content-Length: the limit is found while reading
        for _ in range(LIMIT // 4096 + 2):
            yield b" " * 4096
    r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # just under the limit is read (and refused for its length in characters)
    err = post(srv, "/v1/completions", json.dumps({"prompt": "a" * (LIMIT - 100)}), 400)
    assert err["code"] == "context_length_exceeded"


# ------------------------------------------------------------------------------ text that is not text
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\udfff"], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\udc00"}]}, "messages"),
], ids=["prompt", "prompt-list", "chat", "chat-part", "chat-name"])
def test_lone_surrogates_are_400(srv, path, body, param):
    err = post(srv, path, body, 400)
    assert err["param"] == param and "lone surrogate" in err["message"]


def test_a_surrogate_pair_is_one_character_and_runs(srv):
    out = post(srv, "/v1/completions", '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}', 200)
    assert out["choices"][0]["finish_reason"] in ("length", "stop")


# ------------------------------------------------------------------------------ long prompts
def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(srv):
    front = srv.server.config.app.state.tieredkv
    tok, m = front.tokenizer, front.chars_per_token  # the counting tokenizer; the bound from the vocabulary
    assert m == max(len(t) for t in tok.backend.get_vocab(with_added_tokens=True))
    before = tok.chars
    too_long = "a" * (MAX_LEN * m)  # at least MAX_LEN tokens, whatever they are
    err = post(srv, "/v1/completions", {"prompt": too_long, "max_tokens": 2}, 400)
    assert err["code"] == "context_length_exceeded" and f"{MAX_LEN * m} characters" in err["message"]
    err = post(srv, "/v1/completions", {"prompt": ["ok", too_long], "max_tokens": 2}, 400)
    assert err["message"].startswith("This model's") and "prompt 1 of 2" in err["message"]
    err = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": too_long[:len(too_long) // 2]},
                                                          {"role": "user", "content": too_long[:len(too_long) // 2]}]},
               400)
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert tok.chars == before, "a prompt that cannot fit was tokenized"
    # one character less than the bound may fit: it is tokenized, then refused by its token count
    err = post(srv, "/v1/completions", {"prompt": "a" * (MAX_LEN * m - m), "max_tokens": 2}, 400)
    assert err["code"] == "context_length_exceeded" and "tokens" in err["message"] and tok.chars > before


def test_health_stays_responsive_while_prompts_are_tokenized(gguf):
    """A batch of prompts worth seconds of tokenizing (each fits, the last is too long in tokens
    but not in characters): /health, probed meanwhile, answers in a fraction of that time."""
    served = EngineArgs(model=str(gguf), kv={"device_budget": "25%"}, scheduler={"max_model_len": 2048}).build()
    s = ServerThread(served)
    try:
        rng = random.Random(0)
        letters = "abcdefghijklmnopqrstuvwxyz      "
        prompts = ["".join(rng.choices(letters, k=1900)) for _ in range(40)]
        prompts = [prompts[k % 40][k % 7:] + prompts[(k + 1) % 40][: k % 7] for k in range(2400)]
        prompts.append("".join(rng.choices(letters, k=20000)))
        body = json.dumps({"prompt": prompts, "max_tokens": 1})
        latencies: list[float] = []
        done = threading.Event()

        def probe() -> None:
            with httpx.Client(timeout=60) as http:
                while not done.is_set():
                    t0 = time.perf_counter()
                    assert http.get(s.url + "/health").status_code == 200
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.02)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=120)
        elapsed = time.perf_counter() - t0
        done.set()
        prober.join(60)
        assert r.status_code == 400 and "prompt 2400 of 2401" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert elapsed > 0.5, "the batch was too quick to tell a blocked event loop"
        assert len(latencies) >= 5 and max(latencies) < elapsed / 3, (max(latencies), elapsed)
    finally:
        s.close()


def test_tokenizing_releases_the_gil(gguf):
    """The tokenizer encodes with the GIL released, so the thread a server gives it does not
    stop the event loop's thread."""
    from tieredkv.models.loading import load_checkpoint

    tok = load_checkpoint(gguf).tokenizer
    text = "".join(random.Random(1).choices("abcdefghij ", k=1_000_000))
    ticks, done = [0], threading.Event()

    def count() -> None:
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    worker = threading.Thread(target=lambda: (tok.encode(text), done.set()))
    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.05)
    start = ticks[0]
    t0 = time.perf_counter()
    worker.start()
    worker.join()
    elapsed = time.perf_counter() - t0
    counter.join()
    assert elapsed > 0.2 and ticks[0] - start >= 20, (ticks[0] - start, elapsed)


# ------------------------------------------------------------------------------ shutdown
def _stream_lines(url: str, path: str, body: dict, out: list) -> None:
    try:
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line:
                    out.append(line)
    except httpx.HTTPError as exc:  # a cut stream: recorded for the assertion
        out.append(f"cut: {exc!r}")


def _plain(url: str, path: str, body: dict, out: list) -> None:
    try:
        r = httpx.post(url + path, json=body, timeout=120)
        out.extend([r.status_code, r.headers.get("content-type"), r.text])
    except httpx.HTTPError as exc:
        out.append(f"cut: {exc!r}")


def test_sigterm_drains_then_ends_every_request_with_the_documented_error(tmp_path):
    """``tieredkv serve`` with seven long requests (three streaming) and two short ones in
    flight, SIGTERM: the short ones finish, the long ones end after the grace period with the
    503 OpenAI error (plain) or an error event and ``data: [DONE]`` (streams); nothing new is
    admitted; the process exits 0 with no traceback or error in its log."""
    gguf = write_gguf(tmp_path / "long.gguf", tiny_model(seed=1, max_position_embeddings=32768))
    log = tmp_path / "serve.log"
    grace = 6
    proc, url = start_cli(["--model", str(gguf), "--max-num-seqs", "16", "--shutdown-timeout", str(grace),
                           "--log-level", "info"], log)
    try:
        long = {"max_tokens": 30000, "ignore_eos": True}
        jobs = {  # name -> (runner, path, body)
            "plain-1": (_plain, "/v1/completions", {"prompt": "one", **long}),
            "plain-batch": (_plain, "/v1/completions", {"prompt": ["two", "three"], **long}),
            "plain-chat": (_plain, "/v1/chat/completions", {"messages": CHAT, **long}),
            "stream-1": (_stream_lines, "/v1/completions", {"prompt": "four", **long}),
            "stream-2": (_stream_lines, "/v1/completions", {"prompt": "five", **long}),
            "stream-chat": (_stream_lines, "/v1/chat/completions", {"messages": CHAT, **long}),
        }
        results = {name: [] for name in jobs}
        threads = [threading.Thread(target=fn, args=(url, path, body, results[name]), daemon=True)
                   for name, (fn, path, body) in jobs.items()]

        def running() -> float:
            text = httpx.get(url + "/metrics", timeout=30).text
            return float(next(line.split()[-1] for line in text.splitlines()
                              if line.startswith("tieredkv_requests_running ")))

        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while running() < 7:
            assert time.monotonic() < deadline, "the long requests did not start"
            time.sleep(0.05)
        short = {"max_tokens": 8, "ignore_eos": True}
        results["short-plain"], results["short-stream"] = [], []
        extra = [threading.Thread(target=_plain, args=(url, "/v1/completions", {"prompt": "six", **short},
                                                       results["short-plain"]), daemon=True),
                 threading.Thread(target=_stream_lines, args=(url, "/v1/completions", {"prompt": "seven", **short},
                                                              results["short-stream"]), daemon=True)]
        for t in extra:
            t.start()
        # both short ones admitted (or, on a fast machine, done already)
        while running() < 9 and any(t.is_alive() for t in extra):
            assert time.monotonic() < deadline, "the short requests did not start"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        t_signal = time.monotonic()
        time.sleep(0.5)
        try:  # nothing new is admitted
            r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        except httpx.ConnectError:
            pass
        for t in threads + extra:
            t.join(grace + 60)
        assert proc.wait(grace + 30) == 0
        assert time.monotonic() - t_signal >= grace - 0.5
    finally:
        stop_cli(proc)
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text and "stopped (SIGTERM)" in text, text[-3000:]
    assert "cancelling 7 request(s)" in text
    for name in ("plain-1", "plain-batch", "plain-chat"):
        status, ctype, body = results[name]
        assert status == 503 and ctype == "application/json", (name, results[name])
        assert json.loads(body)["error"]["code"] == "server_shutting_down"
    for name in ("stream-1", "stream-2", "stream-chat"):
        lines = results[name]
        assert lines[0] == 200 and lines[-1] == "data: [DONE]", (name, lines[-3:])
        assert json.loads(lines[-2][6:])["error"]["code"] == "server_shutting_down"
        assert len(lines) > 5  # it streamed before it was ended
    status, _, body = results["short-plain"]
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 8
    lines = results["short-stream"]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
