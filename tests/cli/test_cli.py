"""The CLI contract: --json puts one JSON object on the last stdout line; anticipated
errors print `error: ...` and exit 2 without a traceback."""

import json
import subprocess
import sys

import pytest

from helpers import tiny_model, write_gguf
from tieredkv.cli import main


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return str(write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", tiny_model(seed=41)))


def last_json(capsys):
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_generate_json(tiny_gguf, capsys):
    assert main(["generate", "--model", tiny_gguf, "--prompt", "the cat", "--max-new-tokens", "5", "--json"]) == 0
    d = last_json(capsys)
    assert d["prompt_tokens"] > 0 and d["generated_tokens"] <= 5 and d["kv_bytes"] > 0
    assert d["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # 2 layers x K,V x 2 heads x 16 dims x fp32
    assert {"prefill_tok_s", "decode_tok_s", "text"} <= d.keys()


def test_generate_batch_and_sampling(tiny_gguf, capsys):
    assert main(["generate", "--model", tiny_gguf, "--prompt", "a", "--prompt", "the sun", "--temperature", "0.8",
                 "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "4", "--json"]) == 0
    assert len(last_json(capsys)["completions"]) == 2


def test_info(tiny_gguf, capsys):
    assert main(["info", "--model", tiny_gguf, "--json"]) == 0
    d = last_json(capsys)
    assert d["config"]["num_layers"] == 2 and d["parameters"] > 0
    assert main(["info", "--preset", "llama3-70b", "--json"]) == 0
    assert last_json(capsys)["kv_bytes_per_token"]["fp16"] == 2 * 80 * 8 * 128 * 2


def test_eval_commands(tiny_gguf, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the sun rose over the sea and the cat sat on the mat. " * 60)
    assert main(["eval", "perplexity", "--model", tiny_gguf, "--text-file", str(text), "--window", "64",
                 "--max-windows", "2", "--json"]) == 0
    d = last_json(capsys)
    assert d["windows"] == 2 and d["perplexity"] > 1
    assert main(["eval", "passkey", "--model", tiny_gguf, "--haystack-file", str(text), "--context", "300",
                 "--trials", "2", "--json"]) == 0
    d = last_json(capsys)
    assert d["trials"] == 2 and "mean_logprob" in d


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--model", "/no/such/model.gguf", "--prompt", "x"], "no such file"),
    (["generate", "--model", "llama-17b", "--prompt", "x"], "not a known model name"),
    (["info", "--preset", "gpt5"], "unknown shape preset"),
    (["eval", "passkey", "--context", "9000"], None),
    (["eval", "passkey", "--context", "2040", "--trials", "1"], "plus the answer"),  # the key and 4 tokens do not fit
    (["eval", "perplexity", "--window", "4096"], None),
])
def test_errors_are_clean(argv, needle, tiny_gguf, capsys):
    if argv[0] == "eval":
        argv = argv + ["--model", tiny_gguf]
        needle = needle or "does not fit the model context"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: ") and needle in err and "Traceback" not in err


def test_prompt_too_long(tiny_gguf, capsys):
    assert main(["generate", "--model", tiny_gguf, "--prompt", "the " * 3000]) == 2
    assert "the model context is 2048 tokens" in capsys.readouterr().err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "tieredkv.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout and "eval" in out.stdout


def test_generate_tiered_flags(tiny_gguf, tmp_path, capsys):
    argv = ["generate", "--model", tiny_gguf, "--prompt", "the cat sat on the mat and the sun rose " * 30,
            "--max-new-tokens", "8", "--kv-budget", "60%", "--policy", "h2o", "--mode", "masked",
            "--page-size", "8", "--stats", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out.strip().splitlines()[-1])
    assert d["kv_config"]["migration"]["policy"] == "h2o" and d["kv_config"]["page_size"] == 8
    assert d["tier_metrics"]["decode_steps"] == d["decode_steps"] and "hit_rate" in d["tier_metrics"]
    assert "hits" in captured.err  # --stats prints the metrics


def test_generate_warm_codec_flags(tiny_gguf, capsys):
    argv = ["generate", "--model", tiny_gguf, "--prompt", "the cat sat on the mat and the sun rose " * 30,
            "--max-new-tokens", "8", "--kv-budget", "60%", "--warm-codec", "int4", "--warm-fraction", "0.6",
            "--kv-dtype", "float16", "--page-size", "8", "--stats", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out.strip().splitlines()[-1])
    assert d["kv_config"]["warm"]["codec"] == "int4" and d["kv_config"]["kv_dtype"] == "float16"
    assert d["tier_metrics"]["compressed_pages"] > 0 and "warm (compressed) sub-tier" in captured.err
    assert main(["generate", "--model", tiny_gguf, "--prompt", "x", "--warm-codec", "zstd"]) == 2
    assert "warm_codec (warm.codec): unknown value 'zstd'" in capsys.readouterr().err
    # a bare --warm-codec selects the measured default codec (int4) at the default share
    assert main(["generate", "--model", tiny_gguf, "--prompt", "the cat sat " * 40, "--max-new-tokens", "2",
                 "--kv-budget", "60%", "--page-size", "8", "--warm-codec", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["kv_config"]["warm"] == {"codec": "int4", "fraction": "auto", "exact_reads": "auto", "ladder": None}
    assert main(["generate", "--model", tiny_gguf, "--prompt", "x", "--max-new-tokens", "1",
                 "--warm-fraction", "auto", "--warm-exact-reads", "2", "--json"]) == 0
    assert last_json(capsys)["kv_config"]["warm"] == {"codec": "int4", "fraction": "auto", "exact_reads": 2,
                                                      "ladder": None}
    # a warm ladder: int4 on top, int2 below with half the warm bytes; its rungs in the budget line
    assert main(["generate", "--model", tiny_gguf, "--prompt", "the cat sat on the mat " * 30, "--max-new-tokens",
                 "4", "--kv-budget", "60%", "--page-size", "8", "--warm-fraction", "0.6", "--warm-ladder",
                 "int2:0.5", "--stats", "--json"]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out.strip().splitlines()[-1])
    assert d["kv_config"]["warm"]["ladder"] == "int2:0.5" and "rungs of the ladder" in captured.err
    assert main(["generate", "--model", tiny_gguf, "--prompt", "x", "--warm-ladder", "int2"]) == 2
    assert "warm_ladder (warm.ladder): rung 'int2': expected codec:share" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", tiny_gguf, "--prompt", "x", "--warm-exact-reads", "lots"])
    assert exc.value.code == 2 and "invalid auto-or-integer value: 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse: a usage error names what it expects
        main(["generate", "--model", tiny_gguf, "--prompt", "x", "--warm-fraction", "most"])
    assert exc.value.code == 2 and "invalid auto-or-number value: 'most'" in capsys.readouterr().err


def test_kv_config_file_and_errors(tiny_gguf, tmp_path, capsys):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("policy: lru\nmode: exact\nrecent_tokens: 16\n")
    text = tmp_path / "t.txt"
    text.write_text("the sun rose over the sea and the cat sat on the mat. " * 60)
    assert main(["eval", "perplexity", "--model", tiny_gguf, "--text-file", str(text), "--window", "512",
                 "--max-windows", "1", "--context-fraction", "0.75", "--kv-config", str(cfg), "--kv-budget", "50%",
                 "--json"]) == 0
    d = last_json(capsys)
    assert d["method"]["policy"] == "lru" and d["stats"]["decode_steps"] == 128
    assert main(["generate", "--model", tiny_gguf, "--prompt", "x", "--policy", "fifo"]) == 2
    assert "policy (migration.policy): unknown value 'fifo'" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_gguf, "--prompt", "x y z", "--kv-budget", "1%"]) == 2
    assert "too small to hold the hot window" in capsys.readouterr().err


def test_eval_passkey_with_tiered_flags_and_attention_budget(tiny_gguf, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the sun rose over the sea and the cat sat on the mat. " * 60)
    argv = ["eval", "passkey", "--model", tiny_gguf, "--haystack-file", str(text), "--context", "400", "--trials", "2",
            "--kv-budget", "50%", "--attention-budget", "25%", "--mode", "masked", "--policy", "lru", "--page-size",
            "8", "--selection-aggregate", "head-rank", "--budget-reference", "float32", "--stats", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out.strip().splitlines()[-1])
    assert d["method"]["policy"] == "lru" and d["method"]["mode"] == "masked"
    assert d["method"]["selection_aggregate"] == "head-rank"
    stats = d["stats"]
    assert stats["sessions"] == 2 and stats["decode_steps"] > 0 and stats["pages_per_tier"]["T3"] > 0
    assert len(stats["resident_bytes_series"]) > 0 and stats["resident_bytes_series_stride"] >= 1
    assert "tier metrics over 2 session(s)" in captured.err and "pages per tier" in captured.err  # formatted
    # the attention budget (25% of the window, in pages) caps what a decode step attends, T0 included
    assert main(argv[:-2] + ["--attention-budget", "1%", "--json"]) == 2
    assert "cannot cover T0" in capsys.readouterr().err


def test_offline_policy_is_refused(tiny_gguf, capsys):
    assert main(["generate", "--model", tiny_gguf, "--prompt", "the cat " * 40, "--kv-budget", "60%", "--policy",
                 "belady", "--page-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "offline oracle" in err and "Traceback" not in err


@pytest.mark.slow
def test_serve_bench(tiny_gguf, tmp_path, capsys):
    """The serving benchmark end to end on the tiny model (the essays as text): every arm runs
    the chat workload, the tables are written and --json carries the rows."""
    argv = ["serve-bench", "--model", tiny_gguf, "--suite", "concurrency", "--clients", "2", "--sessions", "2",
            "--turns", "2", "--system-tokens", "32", "--max-new-tokens", "3", "--budget-tokens", "512",
            "--max-model-len", "256", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    rows = last_json(capsys)["concurrency"]
    assert [r["arm"] for r in rows] == ["contiguous", "paged-recompute", "paged-reserve", "tiered-exact",
                                        "tiered-exact-oversubscribe", "tiered-masked"]
    assert all(r["requests"] == 4 and r["errors"] == 0 and r["crashed"] is None for r in rows)
    assert rows[3]["quality"]["identical"] == 1.0
    assert "| tiered-exact |" in (tmp_path / "table.md").read_text()
    with pytest.raises(SystemExit) as exc:
        main(["serve-bench", "--suite", "nope"])
    assert exc.value.code == 2


def test_generate_prefetch_and_access_log_flags(tiny_gguf, tmp_path, capsys):
    logs = tmp_path / "logs"
    argv = ["generate", "--model", tiny_gguf, "--prompt", "the cat sat on the mat and the sun rose " * 30,
            "--max-new-tokens", "8", "--kv-budget", "30%", "--attention-budget", "20%", "--page-size", "8",
            "--prefetch", "vote", "--prefetch-distance", "3", "--access-log", str(logs), "--stats", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out.strip().splitlines()[-1])
    assert d["kv_config"]["prefetch"]["predictor"] == "vote" and d["kv_config"]["prefetch"]["distance"] == 3
    assert "prefetch_precision" in d["tier_metrics"] and "prefetch:" in captured.err
    assert len(list(logs.glob("seq-*.pt"))) == 1
    assert main(["generate", "--model", tiny_gguf, "--prompt", "x", "--prefetch", "psychic"]) == 2
    assert "prefetch_predictor (prefetch.predictor): unknown value 'psychic'" in capsys.readouterr().err


def test_stats_and_json_state_the_budget_bytes_and_reference(tiny_gguf, tmp_path, capsys):
    """Issue #35: a percentage counts the full cache's bytes in --budget-reference (float16 by
    default) whatever the pages are stored in (the tiny model's float32 here); --stats and
    --json say the bytes and the reference, for generate and for an evaluation."""
    argv = ["generate", "--model", tiny_gguf, "--prompt", "the cat sat " * 40, "--max-new-tokens", "4",
            "--max-model-len", "512", "--kv-budget", "50%", "--page-size", "8", "--stats", "--json"]
    got = {}
    for ref in ("float16", "float32", None):
        assert main(argv + (["--budget-reference", ref] if ref else [])) == 0
        captured = capsys.readouterr()
        d = json.loads(captured.out.strip().splitlines()[-1])
        b = got[ref] = d["kv_budgets"]
        assert b["reference_dtype"] == d["kv_config"]["budgets"]["reference_dtype"] == (ref or "float16")
        assert b["stored_dtype"] == "float32"
        assert f"device budget 50% of the full cache's {ref or 'float16'} bytes = {b['device']['bytes']} B" \
            in captured.err
    kv_tok = d["kv_bytes_per_token"]  # float32, all layers
    assert got["float16"] == got[None]
    assert got["float16"]["device"]["bytes"] == 512 * kv_tok // 4 and got["float32"]["device"]["bytes"] == 512 * kv_tok // 2
    assert 2 * got["float16"]["device_pages"] == got["float32"]["device_pages"] == 32
    text = tmp_path / "t.txt"
    text.write_text("the sun rose over the sea and the cat sat on the mat. " * 60)
    assert main(["eval", "perplexity", "--model", tiny_gguf, "--text-file", str(text), "--window", "512",
                 "--max-windows", "1", "--context-fraction", "0.75", "--kv-budget", "50%", "--page-size", "8",
                 "--stats", "--json"]) == 0
    captured = capsys.readouterr()
    d = json.loads(captured.out.strip().splitlines()[-1])
    assert d["kv_budgets"]["device"] == got["float16"]["device"]
    assert "budgets (the last session's):\ndevice budget 50% of the full cache's float16 bytes" in captured.err
    with pytest.raises(SystemExit):
        main(argv + ["--budget-reference", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_generate_percentage_budget_of_max_model_len(tiny_gguf, capsys):
    """A percentage budget is a share of --max-model-len tokens per prompt (default: the model's
    context), so a short prompt runs under it."""
    assert main(["generate", "--model", tiny_gguf, "--prompt", "Hi", "--max-new-tokens", "4", "--kv-budget", "25%",
                 "--json"]) == 0
    d = last_json(capsys)
    assert d["generated_tokens"] <= 4 and d["tier_metrics"]["decode_steps"] >= 1
    assert main(["generate", "--model", tiny_gguf, "--prompt", "the cat " * 40, "--max-model-len", "40"]) == 2
    assert "the model context is 40 tokens" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_gguf, "--prompt", "x", "--max-model-len", "4096"]) == 2
    assert "max_model_len must be an integer in [2, 2048]" in capsys.readouterr().err


def test_serve_refuses_bad_limits_before_loading(capsys):
    for flag, value, message in (("--shutdown-timeout", "-1", "expected a number of seconds in [0, 3600]"),
                                 ("--shutdown-timeout", "soon", "expected a number of seconds"),
                                 ("--max-request-bytes", "0", "expected a positive integer")):
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--model", "/nonexistent.gguf", flag, value])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert main(["serve", "--model", "/nonexistent.gguf", "--port", "0", "--remote-kv-secret", "k" * 32]) == 2
    assert "give --remote-kv URL with it" in capsys.readouterr().err
