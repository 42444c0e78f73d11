"""The OpenAI-compatible server (runtime/serving/openai_server.py) through the official
``openai`` client and httpx against real uvicorn servers on 127.0.0.1: a tiered-cache server
in a thread (most tests), a plain paged one with an API key, and ``tieredkv serve`` as a
subprocess (stopped by SIGTERM). The tiny random Llama makes them fast; the slow test serves
the real SmolLM2."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from helpers import tiny_model, write_gguf
from servers import REPO, ServerThread, assert_no_leak, error_of, start_cli, stop_cli
from tieredkv.runtime.sampling import SamplingParams
from tieredkv.runtime.serving.deploy import EngineArgs
from tieredkv.runtime.serving.openai_server import bind_socket

MAX_LEN = 512
MODEL = "tiny"  # the served name: the checkpoint file's name without .gguf
# the tiny model's float32 pages: the 25 % counts their bytes (8 sequences' T0 must fit)
TIERED = dict(kv={"device_budget": "25%", "budget_reference": "float32"},
              scheduler={"max_model_len": MAX_LEN, "max_num_seqs": 8})
PAGED = dict(scheduler={"max_model_len": MAX_LEN, "max_num_seqs": 8})
PROMPTS = ["Hello there, the world", "the cat sat on the mat", "in the beginning", "a", "seven sins and the sea"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi to the world"}]


def reference(served_args: dict, gguf: Path, prompt_ids: list[int], params: SamplingParams):
    """The in-process Engine's completion for the same settings."""
    engine = EngineArgs(model=str(gguf), **served_args).build().engine
    req = engine.add_request(prompt_ids, params)
    engine.run()
    return req.out


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("openai") / "tiny.gguf", tiny_model(seed=1))


@pytest.fixture(scope="module")
def srv(gguf):
    s = ServerThread(EngineArgs(model=str(gguf), **TIERED).build())
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return srv.client()


# ------------------------------------------------------------------------------ basics
def test_models_and_health(srv, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert error_of(e.value)["code"] == "model_not_found"
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200


@pytest.mark.parametrize("prompt", [PROMPTS[0], [5, 80, 81, 261, 90]], ids=["text", "token-ids"])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_greedy_completion_equals_the_engine(srv, client, gguf, prompt, ignore_eos):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": ignore_eos})
    ids = srv.served.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    want = reference(TIERED, gguf, ids, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=ignore_eos))
    (choice,) = r.choices
    assert choice.model_extra["token_ids"] == want.token_ids
    assert choice.text == want.text
    assert choice.finish_reason == {"length": "length", "eos": "stop"}[want.finish_reason]
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.token_ids))
    assert r.usage.total_tokens == len(ids) + len(want.token_ids)
    if ignore_eos:
        assert r.usage.completion_tokens == 24 and choice.finish_reason == "length"


def test_greedy_chat_equals_the_engine(srv, client, gguf):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=20, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    tok = srv.served.tokenizer
    ids = tok.encode(tok.apply_chat_template(CHAT))
    want = reference(TIERED, gguf, ids, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.model_extra["token_ids"] == want.token_ids and r.model_extra["prompt_token_ids"] == ids
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 20, len(ids) + 20)
    assert choice.finish_reason == "length"


def test_batch_of_prompts(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "cache_salt": "tenant-a"})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(PROMPTS, r.choices):
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert c.text == alone.choices[0].text
    assert r.usage.completion_tokens == 18


# ------------------------------------------------------------------------------ streaming
def test_streaming_completion(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 16
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert len({c.id for c in chunks}) == 1

    echo = client.completions.create(stream=True, echo=True, **kw)
    assert "".join(c.choices[0].text for c in echo) == PROMPTS[1] + whole.choices[0].text
    assert client.completions.create(echo=True, **kw).choices[0].text == PROMPTS[1] + whole.choices[0].text


def test_streaming_chat(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    u, w = chunks[-1].usage, whole.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (w.prompt_tokens, 12, w.total_tokens)
    plain = list(client.chat.completions.create(stream=True, **kw))  # no usage chunk without include_usage
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


def test_concurrent_streams(srv, client):
    """More streams than max_num_seqs at once: all complete, each with its own greedy output."""
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS][:12]
    want = [client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one(ac: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, int]:
        stream = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, used = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            else:
                used = c.usage.completion_tokens
        return text, finish, used

    async def main():
        async with srv.async_client() as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    got = asyncio.run(main())
    assert [g[0] for g in got] == want
    assert all(g[1:] == ("length", 10) for g in got)
    srv.wait_idle()
    srv.on_engine(lambda: assert_no_leak(srv.served.engine))


# ------------------------------------------------------------------------------ sampling and stopping
def test_stop_strings(client):
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    k = next(k for k in range(len(full) // 3, len(full) - 2) if "\ufffd" not in full[k: k + 2]
             and full.find(full[k: k + 2]) == k)
    stop = full[k: k + 2]
    r = client.completions.create(stop=["never-generated-xyz", stop], **kw)
    assert r.choices[0].text == full[:k] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == full[:k]
    assert streamed[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0,
                                          stop="never-generated-xyz", extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"


def test_max_tokens(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, max_tokens=50,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    # no max_tokens: up to the served length
    ids = [10 + i % 400 for i in range(MAX_LEN - 4)]
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_seed_is_reproducible(srv, client, gguf):
    kw = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0.9, top_p=0.95,
              extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 50})
    a = client.completions.create(seed=1234, **kw).choices[0].model_extra["token_ids"]
    b = client.completions.create(seed=1234, **kw).choices[0].model_extra["token_ids"]
    c = client.completions.create(seed=99, **kw).choices[0].model_extra["token_ids"]
    assert a == b and a != c
    want = reference(TIERED, gguf, srv.served.tokenizer.encode(PROMPTS[3]),
                     SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                                    ignore_eos=True))
    assert a == want.token_ids


# ------------------------------------------------------------------------------ metrics
def test_metrics_move(srv, client):
    srv.wait_idle()
    before = srv.metrics()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=7, extra_body={"ignore_eos": True})
    after = srv.metrics()
    assert after["tieredkv_generation_tokens_total"] - before["tieredkv_generation_tokens_total"] == 7
    assert after["tieredkv_prompt_tokens_total"] - before["tieredkv_prompt_tokens_total"] == r.usage.prompt_tokens
    key = "tieredkv_requests_finished_total{finish_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    assert after["tieredkv_engine_steps_total"] > before["tieredkv_engine_steps_total"]
    assert after["tieredkv_requests_running"] == 0
    assert "tieredkv_kv_tier_bytes" in after and "tieredkv_ttft_seconds{quantile=0.5}" in after


# ------------------------------------------------------------------------------ cancellation
def _cancelled(srv) -> float:
    return srv.metrics().get("tieredkv_requests_finished_total{finish_reason=cancelled}", 0.0)


def _wait_cancelled(srv, target: float) -> None:
    deadline = time.monotonic() + 20
    while _cancelled(srv) < target:
        assert time.monotonic() < deadline, "the engine request was not cancelled"
        time.sleep(0.05)


def test_disconnect_mid_stream_cancels_and_frees(srv):
    srv.wait_idle()
    cancelled = _cancelled(srv)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 450, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            got = []
            for line in lines:
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                    if len(got) == 3:
                        break
    assert all(c["choices"][0]["finish_reason"] is None for c in got)
    _wait_cancelled(srv, cancelled + 1)
    srv.wait_idle()
    srv.on_engine(lambda: assert_no_leak(srv.served.engine))
    after = srv.on_engine(lambda: list(srv.served.engine.metrics.requests)[-1].output_tokens)
    assert after < 450


def test_disconnect_while_waiting_cancels(srv):
    srv.wait_idle()
    cancelled = _cancelled(srv)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    _wait_cancelled(srv, cancelled + 1)
    srv.wait_idle()
    srv.on_engine(lambda: assert_no_leak(srv.served.engine))


# ------------------------------------------------------------------------------ errors
def test_bad_requests(srv, client):
    def raw(path: str, content: str | bytes, status: int) -> dict:
        r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, r.text
        assert "Traceback" not in r.text
        return r.json()["error"]

    err = raw("/v1/completions", json.dumps({"model": MODEL, "max_tokens": 3}), 400)
    assert err["param"] == "prompt" and "missing" in err["message"]
    err = raw("/v1/completions", '{"model": "tiny-test", "prompt": "hi",', 400)
    assert "not valid JSON" in err["message"] and err["type"] == "invalid_request_error"
    raw("/v1/chat/completions", "[1, 2]", 400)
    err = raw("/v1/completions", json.dumps({"prompt": [["a"]]}), 400)
    assert err["param"] == "prompt" and "expected one of" in err["message"]
    err = raw("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "many"}), 400)
    assert err["param"] == "max_tokens"
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert error_of(e.value)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=1000)
    assert "temperature" in error_of(e.value)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", top_p=0)
    assert error_of(e.value)["param"] == "top_p"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="hi")
    assert error_of(e.value)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=CHAT)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[3 + i % 400 for i in range(MAX_LEN)])
    err = error_of(e.value)
    assert str(MAX_LEN) in err["message"] and err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the " * 600}])
    assert str(MAX_LEN) in error_of(e.value)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=list(range(3, 103)), max_tokens=MAX_LEN)
    assert "max_tokens" in error_of(e.value)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert error_of(e.value)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", n=2)
    assert error_of(e.value)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", logprobs=2)
    assert "logprobs" in error_of(e.value)["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1, 2, 10 ** 6], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", stop=[""])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, stream_options={"include_usage": True})
    # nothing was queued by any of them
    srv.wait_idle()
    srv.on_engine(lambda: assert_no_leak(srv.served.engine))


# ------------------------------------------------------------------------------ the plain paged cache, auth, 500s
class BrokenTokenizer:
    """The model's tokenizer, except that encoding "boom" fails (an unexpected server error)."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def encode(self, text, **kw):
        if text == "boom":
            raise RuntimeError("secret internal detail")
        return self.tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_paged_server_with_api_key(gguf):
    served = EngineArgs(model=str(gguf), **PAGED).build()
    s = ServerThread(served, api_key="s3cret", tokenizer=BrokenTokenizer(served.tokenizer))
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert error_of(e.value)["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200  # open without the key

        client = s.client()
        ids = served.tokenizer.encode(PROMPTS[0])
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        want = reference(PAGED, gguf, ids, SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
        assert r.choices[0].model_extra["token_ids"] == want.token_ids and r.choices[0].text == want.text
        kw = dict(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kw))
        assert streamed == client.chat.completions.create(**kw).choices[0].message.content

        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="boom", max_tokens=2)
        err = error_of(e.value)
        assert err["type"] == "server_error" and "secret internal detail" not in e.value.response.text
        assert "tieredkv_kv_bytes_allocated" in s.metrics()
        s.wait_idle()
        s.on_engine(lambda: assert_no_leak(served.engine))
    finally:
        s.close()


def test_health_is_503_when_the_engine_stopped(gguf):
    served = EngineArgs(model=str(gguf), **PAGED).build()
    s = ServerThread(served)
    try:
        assert httpx.get(s.url + "/health").status_code == 200
        s.engine.stop_nowait()
        s.engine.join(20)
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        with pytest.raises(openai.APIStatusError) as e:
            s.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
        assert s.metrics()["tieredkv_requests_running"] == 0  # still answers, read directly
    finally:
        s.close()


# ------------------------------------------------------------------------------ tieredkv serve
def test_cli_serve_end_to_end(gguf, tmp_path):
    """``tieredkv serve`` as users run it: a chat, a stream, then SIGTERM while a stream is in
    flight — the stream still completes (graceful drain) and the process exits 0."""
    log = tmp_path / "serve.log"
    # 50 % of the float16 bytes: the float32 pages of 25 % of the tokens
    proc, url = start_cli(["--model", str(gguf), "--kv-budget", "50%", "--max-model-len", str(MAX_LEN),
                           "--max-num-seqs", "8", "--api-key", "k", "--log-level", "warning",
                           "--shutdown-timeout", "120"], log)
    try:
        assert url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
        assert httpx.get(url + "/health").status_code == 200
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert (first.choices + rest[-1].choices)[-1].finish_reason == "length"
        assert proc.wait(60) == 0
        text = log.read_text()
        assert "stopped (SIGTERM)" in text and "Traceback" not in text
    finally:
        stop_cli(proc)


def test_cli_serve_refuses_a_bad_port():
    busy = bind_socket("127.0.0.1", 0)
    busy.listen()
    try:
        r = subprocess.run([sys.executable, "-m", "tieredkv.cli", "serve", "--port", str(busy.getsockname()[1]),
                            "--model", "/nonexistent.gguf"], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert r.returncode == 2 and "cannot bind" in r.stderr and "Traceback" not in r.stderr
    finally:
        busy.close()


@pytest.mark.slow
def test_cli_serve_smollm(smollm, tmp_path):
    """The real SmolLM2 through ``tieredkv serve`` at a quarter of the KV: greedy chat equals the
    in-process engine's tokens under the same settings."""
    args = EngineArgs(kv={"device_budget": "25%"}, scheduler={"max_model_len": 2048, "max_num_seqs": 8})
    log = tmp_path / "serve.log"
    proc, url = start_cli(["--kv-budget", "25%", "--max-model-len", "2048", "--max-num-seqs", "8"], log, 600)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"return_token_ids": True})
        engine = args.build_engine(smollm.model, smollm.tokenizer)
        req = engine.add_request(r.model_extra["prompt_token_ids"], SamplingParams(max_new_tokens=16))
        engine.run()
        assert r.choices[0].model_extra["token_ids"] == req.out.token_ids
        assert "Paris" in r.choices[0].message.content
        tok = smollm.tokenizer
        assert r.model_extra["prompt_token_ids"] == tok.encode(tok.apply_chat_template(messages))
        chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    finally:
        assert stop_cli(proc) == 0
