"""tools/peers: the vLLM peer harness (processes stopped by pid with their children, the skip
when the peer is not installed, the checkpoint both servers load), the conformance
comparison, the load script's datasets and summaries — and, where the peer venv is present
(``bash tools/peers/setup_vllm.sh``), the CI-sized conformance check against vLLM itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "peers"))

import conformance as cf  # noqa: E402
import harness  # noqa: E402
import load  # noqa: E402

from tieredkv.errors import ConfigError  # noqa: E402


def _alive(pid: int) -> bool:
    return harness._alive(pid)


# ------------------------------------------------------------------------------ processes
SPAWNER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {child!r}])
print(child.pid, flush=True)
time.sleep(600)
"""


def _spawn(tmp_path: Path, child: str) -> tuple[harness.Server, int]:
    server = harness.Server("spawner", [sys.executable, "-c", SPAWNER.format(child=child)], port=1,
                            log_path=tmp_path / "spawner.log", env=dict(os.environ))
    deadline = time.monotonic() + 30
    while not server.log_path.read_text().strip():
        assert time.monotonic() < deadline, "the spawner did not start its child"
        time.sleep(0.05)
    return server, int(server.log_path.read_text().split()[0])


def test_stop_ends_the_server_and_its_children(tmp_path):
    server, child = _spawn(tmp_path, "import time; time.sleep(600)")
    assert child in harness.descendants(server.pid)
    server.stop(timeout=10)
    assert not _alive(server.pid) and not _alive(child)


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path):
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    server, child = _spawn(tmp_path, stubborn)
    time.sleep(0.5)  # let the child install its handler
    t0 = time.monotonic()
    server.stop(timeout=2)
    assert not _alive(child) and not _alive(server.pid)
    assert time.monotonic() - t0 < 10


def test_a_server_that_exits_is_reported_and_what_it_started_is_ended(tmp_path):
    """The server dies before it is healthy, leaving a child behind (as vLLM's API server can
    leave its engine process): the error has the log, and the orphan is ended too."""
    code = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            "print(c.pid, 'no model here', flush=True); sys.exit(2)")
    server = harness.Server("broken", [sys.executable, "-c", code], port=harness.free_port(),
                            log_path=tmp_path / "broken.log", env=dict(os.environ))
    with pytest.raises(harness.ServerStartError, match=r"(?s)broken exited with status 2.*no model here"):
        server.wait_healthy(30)
    orphan = int(server.log_path.read_text().split()[0])
    assert not _alive(orphan)


# ------------------------------------------------------------------------------ the peer's absence
def test_a_missing_peer_venv_is_a_skip_naming_the_setup(tmp_path, monkeypatch):
    monkeypatch.setenv("TIEREDKV_PEERS", str(tmp_path))
    with pytest.raises(harness.PeerUnavailable, match="setup_vllm.sh"):
        harness.find_peer()
    done = subprocess.run([sys.executable, str(ROOT / "tools/peers/harness.py"), "status"], capture_output=True,
                          text=True, env={**os.environ, "TIEREDKV_PEERS": str(tmp_path)}, timeout=120)
    assert done.returncode == harness.EXIT_SKIP and done.stderr.startswith("SKIP: no vLLM peer venv")


def test_a_venv_without_vllm_is_not_taken_for_the_peer(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "vllm-venv")], check=True)
    with pytest.raises(harness.PeerUnavailable, match="lacks vllm aiperf"):
        harness.find_peer(tmp_path / "vllm-venv")


def test_setup_script_skips_when_vllm_cannot_be_installed(tmp_path):
    """No usable Python: the script says SKIP and exits 3 rather than failing (nothing installed)."""
    done = subprocess.run(["bash", str(ROOT / "tools/peers/setup_vllm.sh")], capture_output=True, text=True,
                          env={**os.environ, "PEERS": str(tmp_path), "PYTHON": str(tmp_path / "no-python")},
                          timeout=60)
    assert done.returncode == 3
    assert "SKIP: vLLM cannot be installed here" in done.stderr and "comparison is skipped" in done.stderr


def test_serve_config_is_checked():
    with pytest.raises(ConfigError, match="kv_bytes"):
        harness.ServeConfig(kv_bytes=0)
    with pytest.raises(ConfigError, match="tieredkv_cache"):
        harness.ServeConfig(tieredkv_cache="contiguous")
    with pytest.raises(ConfigError, match="threads"):
        harness.ServeConfig(threads=(os.cpu_count() or 1) + 1)


def test_both_commands_get_the_same_bytes_and_threads(tmp_path):
    cfg = harness.ServeConfig(kv_bytes=123 * 46080, threads=1)
    vargs, venv = harness.vllm_command(harness.Peer(tmp_path), tmp_path, 9, cfg)
    targs, tenv = harness.tieredkv_command(tmp_path, 9, cfg)
    assert vargs[vargs.index("--kv-cache-memory-bytes") + 1] == str(123 * 46080)
    assert targs[targs.index("--kv-budget") + 1] == f"{123 * 46080}B"
    assert "VLLM_CPU_KVCACHE_SPACE" not in venv  # it would override the exact byte count
    assert venv["VLLM_CPU_OMP_THREADS_BIND"] == "0" and tenv["OMP_NUM_THREADS"] == "1"
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--served-model-name"):
        assert vargs[vargs.index(flag) + 1] == targs[targs.index(flag) + 1]
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_key_value_heads": 3,
                                                      "head_dim": 64, "hidden_size": 576, "num_attention_heads": 9}))
    pargs, _ = harness.tieredkv_command(tmp_path, 9, harness.ServeConfig(kv_bytes=123 * 46080, tieredkv_cache="paged"))
    assert pargs[pargs.index("--cache-tokens") + 1] == "123" and "--kv-budget" not in pargs


# ------------------------------------------------------------------------------ comparison logic
def _ans(texts, finish, usage, ids=None, status=200):
    return cf.Answer(status, texts, finish, ids or [None] * len(texts),
                     dict(zip(("prompt_tokens", "completion_tokens", "total_tokens"), usage)))


GREEDY = cf.Case("c", "completions", {"prompt": "x", "max_tokens": 8, "temperature": 0}, "")


def _verdicts(case, a, b):
    return {r.field: r.verdict for r in cf.compare(case, a, b)}


def test_identical_answers_are_the_same():
    a = _ans(["Paris."], ["stop"], (5, 3, 8), [[1, 2, 3]])
    assert set(_verdicts(GREEDY, a, a).values()) == {"same"}


def test_a_greedy_text_difference_is_unexplained():
    v = _verdicts(GREEDY, _ans(["Paris."], ["length"], (5, 8, 13)), _ans(["Lyon."], ["length"], (5, 8, 13)))
    assert v["text"] == "unexplained"


def test_the_end_token_counted_by_vllm_only_is_explained():
    a = _ans(["Hi!"], ["stop"], (5, 3, 8), [[7, 8, 9]])
    b = _ans(["Hi!"], ["stop"], (5, 4, 9), [[7, 8, 9, 2]])
    v = _verdicts(GREEDY, a, b)
    assert v["completion_tokens"] == v["total_tokens"] == v["token_ids"] == "explained: eos-counted"
    # two extra tokens on one choice, or an extra token on a length-ended choice: not that
    two = _ans(["Hi!"], ["stop"], (5, 5, 10), [[7, 8, 9, 2, 2]])
    assert _verdicts(GREEDY, a, two)["completion_tokens"] == "unexplained"
    long_a, long_b = _ans(["Hi"], ["length"], (5, 8, 13)), _ans(["Hi"], ["length"], (5, 9, 14))
    assert _verdicts(GREEDY, long_a, long_b)["completion_tokens"] == "unexplained"


def test_known_differences_are_explained():
    no_max = cf.Case("d", "completions", {"prompt": "x", "temperature": 0}, "")
    v = _verdicts(no_max, _ans(["a b c."], ["stop"], (5, 29, 34)), _ans(["a b"], ["length"], (5, 16, 21)))
    assert v["text"] == v["finish_reason"] == "explained: default-max-tokens"
    n2 = cf.Case("n", "completions", {"prompt": "x", "n": 2, "temperature": 0.8, "seed": 1}, "", sampled=True)
    assert _verdicts(n2, cf.Answer(400), _ans(["a", "b"], ["length"] * 2, (5, 16, 21)))["status"] == \
        "explained: n>1"
    bad = _verdicts(GREEDY, cf.Answer(400, error_type="invalid_request_error"),
                    cf.Answer(400, error_type="BadRequestError"))
    assert bad == {"status": "same", "error_type": "explained: error-type"}
    assert _verdicts(GREEDY, cf.Answer(400), cf.Answer(200))["status"] == "unexplained"


def test_self_checks_catch_a_stream_that_differs():
    one = _ans(["Hi there"], ["length"], (5, 2, 7))
    streamed = _ans(["Hi"], ["length"], (5, 2, 7))
    streamed.stream_ok = True
    rows = cf.self_checks(GREEDY, "tieredkv", streamed, None, one)
    assert [r.verdict for r in rows] == ["self-check failed"]
    streamed.texts = ["Hi there"]
    assert [r.verdict for r in cf.self_checks(GREEDY, "tieredkv", streamed, None, one)] == ["same"]


# ------------------------------------------------------------------------------ load script
@pytest.mark.slow
def test_datasets_have_the_serve_bench_shapes(tmp_path, smollm, pg_ids):
    tok = smollm.tokenizer
    n = lambda text: len(tok.encode(text, add_bos=False))  # noqa: E731
    cfg = load.LoadConfig(sessions_per_client=2, turns=3, system_tokens=200, user_tokens=(20, 40), max_new_tokens=7,
                          doc_tokens=(300, 400), questions=2, doc_new_tokens=4)
    chat = load.write_dataset("chat", tmp_path / "chat.jsonl", tok, pg_ids, clients=3, cfg=cfg, seed=1)
    lines = [json.loads(x) for x in (tmp_path / "chat.jsonl").read_text().splitlines()]
    assert chat == {"type": "multi_turn", "requests": 18, "conversations": 6, "endpoint": "chat"}
    assert len(lines) == 6 and len({line["turns"][0]["text"] for line in lines}) == 1  # one shared system prompt
    assert all(len(line["turns"]) == 4 and line["turns"][0]["role"] == "system" for line in lines)
    assert 180 <= n(lines[0]["turns"][0]["text"]) <= 220
    assert all(t["output_length"] == 7 and 15 <= n(t["text"]) <= 45 for line in lines for t in line["turns"][1:])
    docs = load.write_dataset("docs", tmp_path / "docs.jsonl", tok, pg_ids, clients=3, cfg=cfg, seed=1)
    rows = [json.loads(x) for x in (tmp_path / "docs.jsonl").read_text().splitlines()]
    assert docs["requests"] == 6 and docs["endpoint"] == "completions"
    heads = [r["text"].split("\n\nQuestion: ")[0] for r in rows]
    assert heads[:3] == heads[3:] and len(set(heads[:3])) == 3  # question-major: each document asked twice
    assert all(280 <= n(h) <= 420 for h in heads) and {r["output_length"] for r in rows} == {4}
    load.write_dataset("unique", tmp_path / "u.jsonl", tok, pg_ids, clients=3, cfg=cfg, seed=1)
    texts = [json.loads(x)["text"] for x in (tmp_path / "u.jsonl").read_text().splitlines()]
    assert len(texts) == 6 and len({t[:50] for t in texts}) == 6
    with pytest.raises(ConfigError, match="unknown workload"):
        load.write_dataset("nope", tmp_path / "n.jsonl", tok, pg_ids, clients=1, cfg=cfg, seed=1)


def test_max_concurrency_is_the_highest_run_within_the_slo():
    def row(server, clients, itl, failed=0):
        return {"server": server, "workload": "chat", "clients": clients, "requests": 4, "done": 4, "started": True,
                "failed": failed, "itl_p99": itl, "output_tok_s": float(clients)}
    rows = [row("tieredkv", 1, 0.1), row("tieredkv", 4, 0.5), row("tieredkv", 8, 0.9, failed=1),
            row("vllm", 1, 0.2), row("vllm", 4, 1.5)]
    got = {s["server"]: (s["max_clients"], s["output_tok_s"]) for s in load.max_concurrency(rows, 1.0)}
    assert got == {"tieredkv": (4, 4.0), "vllm": (1, 1.0)}


def test_runs_whose_every_request_failed_and_refused_starts_are_read(tmp_path):
    """aiperf writes no summary when every request failed: the records give the failures; a
    vLLM log that refused to start gives the root cause and the longest length it holds."""
    ok = {"metadata": {"session_num": 0}, "metrics": {"request_latency": {"value": 1.0}}}
    bad = {"metadata": {"session_num": 1}, "metrics": {},
           "error": {"code": 400, "type": "Bad Request", "message": "maximum context length is 3968 tokens"}}
    (tmp_path / "profile_export.jsonl").write_text(json.dumps(ok) + "\n" + json.dumps(bad) + "\n")
    got = load.read_records(tmp_path)
    assert (got["done"], got["failed"], got["error_codes"]) == (1, 1, ["400"]) and "3968" in got["error_sample"]
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\n(EngineCore) ERROR ValueError: To serve at least one request with the model's "
                   "max seq len (8192), ... the estimated maximum model length is 3968. Try ...\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert load._start_error(log).startswith("(EngineCore) ERROR ValueError: To serve")
    assert load.vllm_longest(log) == 3968


# ------------------------------------------------------------------------------ real servers
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return harness.write_checkpoint(tmp_path_factory.mktemp("peers"))


@pytest.mark.slow
def test_checkpoint_is_written_once_and_loads_as_the_same_model(checkpoint, smollm):
    import torch
    from helpers import logits_of

    from tieredkv.models.loading import load_checkpoint

    assert sorted(p.name for p in checkpoint.iterdir()) == ["config.json", "model.safetensors", "source.json",
                                                            "tokenizer.json", "tokenizer_config.json"]
    mtime = (checkpoint / "model.safetensors").stat().st_mtime
    assert harness.write_checkpoint(checkpoint.parents[1]) == checkpoint
    assert (checkpoint / "model.safetensors").stat().st_mtime == mtime  # reused, not written again
    theirs = load_checkpoint(checkpoint)
    ours_sd, theirs_sd = smollm.model.state_dict(), theirs.model.state_dict()
    assert ours_sd.keys() == theirs_sd.keys() and all(torch.equal(ours_sd[k], theirs_sd[k]) for k in ours_sd)
    ids = torch.tensor(smollm.tokenizer.encode("The capital of France is"))
    assert torch.equal(logits_of(smollm.model, ids), logits_of(theirs.model, ids))
    assert theirs.tokenizer.chat_template == smollm.tokenizer.chat_template
    assert theirs.tokenizer.encode("Hi there!") == smollm.tokenizer.encode("Hi there!")
    assert harness.kv_bytes_per_token(checkpoint) == 46080


@pytest.mark.slow
def test_harness_conformance_paged_against_tiered(checkpoint, tmp_path):
    """The conformance runner end to end on two real servers: ``tieredkv serve`` on the plain
    paged cache against the tiered cache at a binding budget — identical in every field."""
    from tieredkv.models.tokenizer import Tokenizer

    suite = [c for c in cf.cases(Tokenizer.from_hf_dir(checkpoint)) if c.ci]
    paged = harness.ServeConfig(tieredkv_cache="paged", max_model_len=2048)
    tiered = harness.ServeConfig(kv_bytes=512 * 46080, max_model_len=2048, max_num_seqs=4)  # prompts overflow it
    with harness.start_tieredkv(checkpoint, paged, tmp_path, name="paged") as a, \
            harness.start_tieredkv(checkpoint, tiered, tmp_path, name="tiered") as b:
        before = load.scrape(b.url)
        rows = cf.run({"tieredkv": a.url, "vllm": b.url}, paged.served_name, suite, log=lambda m: None)
        figures = load.server_figures("tieredkv", before, load.scrape(b.url))
    assert len(rows) > 40 and {r.verdict for r in rows} == {"same"}, cf.markdown(rows, suite)
    assert 0 < figures["prefix_hit_rate"] < 1  # streamed cases repeat their prompt


@pytest.mark.slow
def test_vllm_conformance_ci(checkpoint, tmp_path):
    """The CI-sized conformance check against vLLM itself, where the peer venv is installed
    (vLLM in eager mode: it starts in about half the time, skipping its model compilation)."""
    try:
        peer = harness.find_peer()
    except harness.PeerUnavailable as exc:
        pytest.skip(f"vLLM peer not installed: {exc}")
    from tieredkv.models.tokenizer import Tokenizer

    suite = [c for c in cf.cases(Tokenizer.from_hf_dir(checkpoint)) if c.ci]
    cfg = harness.ServeConfig(vllm_args=("--enforce-eager",))
    with harness.start_tieredkv(checkpoint, cfg, tmp_path) as tkv, \
            harness.start_vllm(peer, checkpoint, cfg, tmp_path) as vllm:
        assert harness.vllm_kv_tokens(vllm) == cfg.kv_bytes // 46080
        rows = cf.run({"tieredkv": tkv.url, "vllm": vllm.url}, cfg.served_name, suite, log=lambda m: None)
    bad = [r for r in rows if r.verdict in ("unexplained", "self-check failed")]
    assert not bad, cf.markdown(rows, suite)
    assert all(r.verdict == "same" for r in rows if r.field == "text")  # greedy text identical everywhere
