"""``freetoken bench --workload shared-prefix`` end to end on the CPU (the demo checkpoint, tiny
prompts): every figure present and consistent with the rounds it summarises. Hits are asserted
only where the engine reports a prefix cache; none is faked."""

from __future__ import annotations

import json
import statistics

import pytest

from freetoken.bench.offline import _check
from freetoken.bench.shared_prefix import pages_needed
from freetoken.cli import build_parser, main

# The prefix spans MIN_SNAPSHOT_GAIN_PAGES (4) demo pages of 16 tokens and part of a fifth: the
# priming request snapshots at token 64, the shortest prefix the scheduler snapshots.
PROMPT_LEN, PREFIX_LEN, REPEATS = 96, 72, 2


def test_shared_prefix_bench_reports_both_ttfts(demo_checkpoint, tmp_path, capsys):
    out = tmp_path / "shared.json"
    argv = ["bench", "--workload", "shared-prefix", "--model", str(demo_checkpoint), "--input-len", str(PROMPT_LEN),
            "--shared-prefix-len", str(PREFIX_LEN), "--repeats", str(REPEATS), "--dtype", "float32",
            "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["workload"] == "shared-prefix" and report["device"] == "cpu" and "results" not in report
    page_size = report["engine_config"]["page_size"]
    assert report["engine_config"]["num_pages"] == pages_needed(PROMPT_LEN, PREFIX_LEN, 0, REPEATS, page_size)
    r = report["shared_prefix"]
    assert (r["prompt_len"], r["shared_prefix_len"], r["prime_tail_len"], r["repeats"]) == (
        PROMPT_LEN, PREFIX_LEN, 0, REPEATS)
    assert len(r["rounds"]) == REPEATS
    assert r["cacheable_tokens"] == PREFIX_LEN // page_size * page_size == 64
    for kind in ("uncached", "cached"):
        assert r[f"ttft_ms_{kind}"] == pytest.approx(statistics.median(x[f"ttft_ms_{kind}"] for x in r["rounds"]))
        assert r[f"ttft_ms_{kind}"] > 0
    assert r["ttft_ratio"] == pytest.approx(r["ttft_ms_cached"] / r["ttft_ms_uncached"])
    assert r["prefill_tok_s_uncached"] == pytest.approx(PROMPT_LEN / r["ttft_ms_uncached"] * 1e3)
    assert r["num_cached_tokens"] == min(x["num_cached_tokens_cached"] for x in r["rounds"])
    assert r["prefill_tok_s_cached"] == pytest.approx((PROMPT_LEN - r["num_cached_tokens"]) / r["ttft_ms_cached"] * 1e3)
    for measured in r["rounds"]:  # fresh random tokens: nothing but the shared prefix can hit
        assert measured["num_cached_tokens_uncached"] == 0 and measured["num_cached_tokens_priming"] == 0
        assert 0 <= measured["num_cached_tokens_cached"] <= r["cacheable_tokens"]
    if r["prefix_caching"]:  # the engine has a prefix cache: the shared prefix must hit, and be counted
        assert r["num_cached_tokens"] > 0
        assert r["prefix_cache_hit_tokens"] == sum(x["num_cached_tokens_cached"] for x in r["rounds"])
        assert r["prefix_cache_queried_tokens"] >= r["prefix_cache_hit_tokens"]
    else:
        assert r["num_cached_tokens"] == 0 and r["prefix_cache_hit_tokens"] is None
    table = capsys.readouterr().out
    assert "TTFT uncached" in table and "cached / uncached" in table and "num_cached_tokens" in table


@pytest.mark.parametrize("extra, message", [
    (["--shared-prefix-len", "64"], r"--shared-prefix-len must be in \[1, --input-len 64\)"),
    (["--repeats", "0"], "--repeats >= 1"),
    (["--compare-transformers"], "decode workload only"),
])
def test_shared_prefix_flags_are_checked(extra, message):
    args = build_parser().parse_args(["bench", "--workload", "shared-prefix", "--preset", "qwen3.6-35b-a3b",
                                      "--input-len", "64", "--shared-prefix-len", "32", *extra])
    with pytest.raises(SystemExit, match=message):
        args.run(args)


def test_shared_prefix_defaults_are_the_issue_12_shape():
    """8k-token prompts whose first 7.5k tokens are cached; the decode workload keeps its 1k prompts."""
    args = build_parser().parse_args(["bench", "--workload", "shared-prefix", "--preset", "qwen3.6-35b-a3b"])
    _check(args)
    assert (args.input_len, args.shared_prefix_len, args.prime_tail_len, args.repeats) == (8192, 7680, 0, 3)
    decode = build_parser().parse_args(["bench", "--preset", "qwen3.6-35b-a3b"])
    _check(decode)
    assert (decode.workload, decode.input_len) == ("decode", 1024)
