"""``tokenserve bench`` end to end with the real default model, tiny workloads (seconds).

No timing assertions: the structure of the results and that token counts come from the
responses (ids streamed back, engine outputs, generate's output), never from the request.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LEVEL_KEYS = {"concurrency", "num_prompts", "ours", "baseline", "ratio", "records"}
SUMMARY_KEYS = {"num_requests", "completed", "failed", "duration_s", "total_output_tokens",
                "request_throughput", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms",
                "e2e_ms", "goodput", "token_sources"}
TINY = ["--input-len", "16", "--output-len", "4", "--warmup", "1", "--no-progress",
        "--max-duration-s", "120"]


def check_summary(s: dict, n: int, source: str, max_out: int) -> None:
    assert SUMMARY_KEYS <= set(s)
    assert s["num_requests"] == n and s["completed"] == n and s["failed"] == 0
    assert s["token_sources"] == [source]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(s[key]) == {"n", "mean", "p50", "p90", "p99"}
    assert s["ttft_ms"]["n"] == n
    assert 0 < s["total_output_tokens"] <= n * max_out


def check_records(records: list[dict], source: str, max_out: int) -> None:
    for r in records:
        assert r["ok"] and r["token_source"] == source
        assert 1 <= r["output_tokens"] <= max_out
        # one ITL per token-carrying chunk after the first: never more than the tokens
        assert len(r["itl"]) <= r["output_tokens"] - 1
        assert r["ttft"] is not None and r["ttft"] <= r["e2e"]


def test_engine_only_with_hf_baseline(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from tokenserve.cli import main

    out = tmp_path / "engine.json"
    rc = main(["bench", "--engine-only", "--num-prompts", "2", "--concurrency", "2",
               "--baseline", "hf", "--dtype", "float32", "--out", str(out),
               "--plot-dir", str(tmp_path / "plots"), *TINY])
    assert rc == 0
    table = capsys.readouterr().out
    assert "ours/hf" in table and "TTFT" in table
    res = json.loads(out.read_text())
    assert res["meta"]["mode"] == "engine" and res["meta"]["dtype"] == "float32"
    (lv,) = res["levels"]
    assert set(lv) == LEVEL_KEYS and lv["concurrency"] == 2
    check_summary(lv["ours"], 2, "engine", 4)
    check_records(lv["records"]["ours"], "engine", 4)
    # generate with min_new_tokens: exactly the requested length, counted from its output
    check_summary(lv["baseline"], 2, "generate", 4)
    assert lv["baseline"]["total_output_tokens"] == 8
    assert all(r["output_tokens"] == 4 for r in lv["records"]["baseline"])
    assert set(lv["ratio"]) >= {"output_throughput", "ttft_mean", "tpot_mean"}
    assert all(v is not None and v > 0 for v in lv["ratio"].values())
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "latency_cdf.png", "throughput_vs_concurrency.png", "ttft_vs_concurrency.png"]


def test_http_mindie_against_a_server_it_starts(tmp_path):
    pytest.importorskip("httpx")
    out = tmp_path / "http.json"
    cmd = [sys.executable, "-m", "tokenserve.cli", "bench", "--backend", "mindie",
           "--num-prompts", "4", "--concurrency", "2", "--out", str(out), *TINY]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mindie over HTTP" in proc.stdout
    res = json.loads(out.read_text())
    assert res["meta"]["mode"] == "http" and res["meta"]["url"].startswith("http://127.0.0.1:")
    (lv,) = res["levels"]
    assert lv["baseline"] is None and lv["ratio"] is None
    check_summary(lv["ours"], 4, "token_ids", 4)
    check_records(lv["records"]["ours"], "token_ids", 4)
    assert {r["index"] for r in lv["records"]["ours"]} == {0, 1, 2, 3}  # warm-up excluded
    assert all(r["input_len"] == 16 for r in lv["records"]["ours"])


def test_bench_kernels_without_checkout_fails_clearly(tmp_path, monkeypatch, capsys):
    """``tokenserve bench kernels`` finds bench/ next to the tokenserve package; the message
    says what to do. The serving benchmark is installed with the package: no checkout."""
    from tokenserve import cli

    fake = tmp_path / "site" / "tokenserve" / "cli.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    monkeypatch.setattr(cli, "__file__", str(fake))
    assert cli.main(["bench", "kernels", "--help"]) == 2
    assert "needs a repository checkout" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    assert "tokenserve bench" in capsys.readouterr().out


def test_engine_only_json_schema_reports_mask_cost(tmp_path, capsys):
    """``--response-format json-schema``: same metrics, plus the engine's mask cost."""
    from tokenserve.cli import main

    out = tmp_path / "schema.json"
    rc = main(["bench", "--engine-only", "--num-prompts", "2", "--concurrency", "2",
               "--dtype", "float32", "--response-format", "json-schema", "--ignore-eos",
               "--out", str(out), *TINY])
    assert rc == 0
    assert "structured-output mask cost: c=2" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["meta"]["response_format"] == "json-schema"
    (lv,) = res["levels"]
    assert set(lv) == LEVEL_KEYS | {"structured_output"}
    check_summary(lv["ours"], 2, "engine", 4)
    assert lv["ours"]["total_output_tokens"] == 2 * 4  # the schema never ends early
    so = lv["structured_output"]
    assert so["mask_steps"] > 0 and so["mask_ms"] > 0
