"""tools/roofline.py: the bytes each kernel of a decode step must move, their roofline times, and
the markdown / JSON it writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import roofline as rl  # noqa: E402

from tieredkv.errors import ConfigError  # noqa: E402
from tieredkv.models.config import PRESETS  # noqa: E402
from tieredkv.plugins import codec  # noqa: E402
from tieredkv.runtime.tiered.step_time import GPUS, weight_bytes  # noqa: E402

SMOL, BIG = PRESETS["smollm2-135m"], PRESETS["llama2-70b"]


def _kv(step: rl.StepBytes) -> float:
    """TieredAttention's bytes less q / out, lse / page_probs and the page metadata."""
    cfg = step.cfg
    per = cfg.num_layers * step.batch
    e = rl.DTYPE_BYTES[step.kv_dtype]
    extra = per * (2 * cfg.num_heads * cfg.head_dim * e + 4 * cfg.num_heads * (1 + step.attended)
                   + rl.PAGE_META * step.attended + 16)
    return step.kernel("TieredAttention").bytes - extra


@pytest.mark.parametrize("cfg", [SMOL, BIG], ids=lambda c: c.name)
@pytest.mark.parametrize("context", [4096, 32768, 1000])
@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_full_attention_moves_all_of_the_context(cfg, context, kv_dtype):
    step = rl.step_bytes(cfg, context=context, kv_dtype=kv_dtype)
    e = rl.DTYPE_BYTES[kv_dtype]
    assert _kv(step) == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * context * e
    assert step.attended == step.pages == -(-context // 16)
    # q / out and the rest are counted, and small
    assert 0 < step.kernel("TieredAttention").bytes - _kv(step) < 0.02 * _kv(step)
    assert [k.name for k in step.kernels if k.in_step] == ["weights (GEMV, fp16)", "TieredAttention",
                                                           "KVAppend (in place)"]


def test_smollm2_full_32k_figures():
    step = rl.step_bytes(SMOL, context=32768)
    assert _kv(step) == 2 * 30 * 3 * 64 * 32768 * 2 == 754_974_720
    t = rl.timing(step, "h200")
    assert t.kernel_us["TieredAttention"] == pytest.approx(1e6 * step.kernel("TieredAttention").bytes / 4.8e12)


@pytest.mark.parametrize("cfg", [SMOL, BIG], ids=lambda c: c.name)
@pytest.mark.parametrize("batch", [1, 3])
def test_tiered_attends_a_quarter_plus_all_summaries(cfg, batch):
    full = rl.step_bytes(cfg, context=32768, batch=batch)
    tiered = rl.step_bytes(cfg, context=32768, method="tiered", batch=batch)
    assert tiered.attended * 4 == tiered.pages == 2048
    assert _kv(tiered) * 4 == _kv(full)
    per, kvh, d = cfg.num_layers * batch, cfg.num_kv_heads, cfg.head_dim
    score = tiered.kernel("ImportanceScore").bytes
    summaries = per * 2048 * 2 * kvh * d * 2  # min and max keys of every page, fp16
    assert summaries < score < summaries * 1.3
    assert summaries * 16 == _kv(full)  # a summary is 1/P of its page
    misses = tiered.kernel("host -> device (misses)")
    assert misses.link and misses.bytes == pytest.approx(per * 0.22 * 512 * 2 * kvh * 16 * d * 2)
    assert rl.step_bytes(cfg, context=32768, method="tiered", miss_rate=0.0).kernel(misses.name).bytes == 0


def test_kv_append_in_place_moves_only_the_new_token():
    step = rl.step_bytes(BIG, context=32768, batch=2)
    new_token = 2 * 8 * 128 * 2  # K and V of one token, one layer, fp16
    assert step.kernel("KVAppend (in place)").bytes == 80 * 2 * (2 * new_token + 16)
    assert step.kernel("KVAppend (in place)").bytes == rl.step_bytes(BIG, context=4096, batch=2).kernel(
        "KVAppend (in place)").bytes  # independent of the context
    copy = step.kernel("KVAppend (copy + scatter, old plugin path)")
    assert not copy.in_step
    assert copy.bytes > 2 * _kv(step)  # the old path read and wrote the whole pool


def test_weights_and_step_total():
    step = rl.step_bytes(BIG, context=32768, method="tiered")
    assert step.kernel("weights (GEMV, fp16)").bytes == weight_bytes(BIG, 2)
    assert rl.step_bytes(BIG, context=32768, batch=4).kernel("weights (GEMV, fp16)").bytes == weight_bytes(BIG, 2)
    for gpu in ("h200", "h100"):
        t = rl.timing(step, gpu)
        assert sum(t.share.values()) == pytest.approx(1.0)
        assert t.step_us == pytest.approx(sum(t.kernel_us[k.name] for k in step.kernels if k.in_step))
        link = GPUS[gpu].link_bytes_per_s
        assert t.kernel_us["host -> device (misses)"] == pytest.approx(
            1e6 * step.kernel("host -> device (misses)").bytes / link)
    assert rl.timing(step, "h100").step_us > rl.timing(step, "h200").step_us


def test_warm_codec_reads_encoded_pages():
    plain = rl.step_bytes(SMOL, context=4096, method="tiered")
    warm = rl.step_bytes(SMOL, context=4096, method="tiered-warm", warm_codec="int4", miss_rate=0.0)
    enc = codec.page_bytes(codec.CODECS["int4"], 3, 16, 64)
    assert _kv(warm) == pytest.approx(30 * 64 * enc)
    assert _kv(warm) < _kv(plain) / 2
    with pytest.raises(ConfigError, match="warm codec"):
        rl.step_bytes(SMOL, context=4096, method="tiered-warm")


def test_decode_attention_is_memory_bound():
    for cfg in (SMOL, BIG):
        ai = rl.intensity(rl.step_bytes(cfg, context=32768))
        assert ai == pytest.approx(2 * cfg.group_size / 2, rel=0.01)  # 2 * (H / KVH) / dtype bytes
        for gpu in ("h200", "h100"):
            tensor, cuda = rl.ridge_points(gpu)
            assert ai < cuda < tensor


def test_cli_writes_markdown_and_keeps_the_rest_of_the_file(tmp_path, capsys):
    out = tmp_path / "roofline.md"
    args = ["--presets", "smollm2-135m", "--contexts", "4096", "--gpus", "h200", "--out", str(out)]
    assert rl.main(args) == 0
    text = out.read_text()
    assert text.startswith(rl.BEGIN) and text.rstrip().endswith(rl.END)
    assert "| smollm2-135m | 4,096 | tiered 25 % |" in text and "TieredAttention" in text
    out.write_text("# Title\n\nprose before\n\n" + text + "\nprose after\n")
    assert rl.main(args + ["--batch", "2"]) == 0
    text = out.read_text()
    assert text.startswith("# Title\n\nprose before\n") and text.endswith("\nprose after\n")
    assert text.count(rl.BEGIN) == 1 and "--batch 2" in text


def test_cli_json(capsys):
    assert rl.main(["--presets", "llama2-70b", "--contexts", "32768", "--gpus", "h200", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["method"] for s in data["steps"]] == ["full", "tiered"]
    assert data["steps"][0]["step_us"]["h200"] > 0


@pytest.mark.parametrize("flag, bad, message", [("--presets", "llama-9000", "unknown shape preset 'llama-9000'"),
                                                ("--gpus", "b300", "unknown GPU model 'b300'")])
def test_cli_bad_names_are_clear_errors(capsys, flag, bad, message):
    with pytest.raises(SystemExit) as exc:
        rl.main([flag, bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "expected one of" in err


def test_cli_refuses_a_file_without_markers(tmp_path, capsys):
    out = tmp_path / "notes.md"
    out.write_text("hand-written\n")
    with pytest.raises(SystemExit):
        rl.main(["--presets", "smollm2-135m", "--contexts", "4096", "--out", str(out)])
    assert out.read_text() == "hand-written\n"
    assert "refusing to overwrite" in capsys.readouterr().err
