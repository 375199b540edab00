"""``freetoken bench`` end to end on the CPU (a tiny checkpoint), its presets, and its plots."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from freetoken.bench.presets import preset_config, write_preset_dir
from freetoken.bench.timing import StepRecorder, busy_time, kernel_table
from freetoken.cli import build_parser, main


def test_bench_writes_every_figure_per_batch_size(demo_checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(demo_checkpoint), "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4",
            "--dtype", "float32", "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["num_layers"] == 4 and report["device"] == "cpu" and report["dtype"] == "float32"
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for result in report["results"]:
        batch = result["batch_size"]
        # One step prefills every prompt (8 tokens each) and samples the first tokens; 3 decode steps.
        assert result["steps"] == 4 and result["steady_steps"] == 3
        assert result["decode_ms_per_step"] > 0
        assert result["decode_tok_s"] == pytest.approx(batch / result["decode_ms_per_step"] * 1e3)
        assert result["prefill_tok_s"] == pytest.approx(batch * 8 / result["ttft_ms_max"] * 1e3)
        assert 0 < result["ttft_ms_mean"] <= result["ttft_ms_max"]
        floor = result["floor"]
        parts = ("non_expert_weight_bytes", "expert_weight_bytes", "kv_bytes", "state_bytes")
        assert floor["total_bytes"] == pytest.approx(sum(floor[p] for p in parts))
        assert all(floor[p] > 0 for p in parts)
        assert floor["experts_per_layer"] == pytest.approx(8 * (1 - (1 - 2 / 8) ** batch))
        assert floor["context_len"] == pytest.approx(8 + 2)  # the steady steps hold 1, 2 and 3 output tokens
        assert result["ratio_to_floor"] == pytest.approx(result["decode_ms_per_step"] / floor["ms"])
        assert result["gpu_idle_share"] is None  # measured on CUDA only
        assert result["activation_peak_mib"] is None and result["alloc_retries"] is None  # CUDA only
        assert result["activation_peak_reserved_mib"] is None and result["max_prefill_length"] > 0
    table = capsys.readouterr().out
    assert "decode ms/step" in table and "x floor" in table and "act. peak MiB (alloc / reserved)" in table


def test_bench_needs_a_model_or_a_preset():
    args = build_parser().parse_args(["bench"])
    with pytest.raises(SystemExit, match="exactly one of --model DIR and --preset NAME"):
        args.run(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--preset", "qwen3.6-35b-a3b", "--batch-sizes", "1,x"])


def test_qwen3_6_preset_is_the_released_shape():
    config = preset_config("qwen3.6-35b-a3b")
    assert config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert config.layer_types.count("full_attention") == 10 and config.num_hidden_layers == 40
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        2048, 16, 2, 256)
    assert (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim) == (16, 32, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 8, 512)
    assert config.shared_expert_intermediate_size == 512 and config.vocab_size == 248320
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert config.max_position_embeddings == 262144


def test_preset_directory_has_a_config_and_no_weights(tmp_path):
    path = write_preset_dir("qwen4-exp", tmp_path / "p", num_layers=2)
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    assert not list(path.glob("*.safetensors"))
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["architectures"] == ["Qwen4ExpForCausalLM"]
    assert config["ple_layer_ids"] == [1]


def test_busy_time_is_the_union_of_intervals():
    assert busy_time([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert busy_time([]) == 0.0


def test_plots_from_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    from freetoken.bench.plot import main as plot_main

    result = {"batch_size": 1, "decode_ms_per_step": 2.0, "ratio_to_floor": 1.5, "floor": {"ms": 1.3},
              "transformers": {"decode_ms_per_step": 50.0, "ratio_to_floor": 38.0}}
    report = {"results": [result, {**result, "batch_size": 16}]}
    (tmp_path / "run.json").write_text(json.dumps(report))
    assert plot_main([str(tmp_path / "run.json"), "--out", str(tmp_path / "png")]) == 0
    for name in ("decode_ms_per_step.png", "ratio_to_floor.png"):
        assert (tmp_path / "png" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _FakeRuntime:
    """Steps of 3 requests: one prefill step that samples every first token, then decodes."""

    def __init__(self, batch_size: int, max_tokens: int) -> None:
        self.batch_size, self.max_tokens, self.produced = batch_size, max_tokens, 0

    def step(self):
        self.produced += 1
        return [SimpleNamespace(token_ids=[0] * self.produced, new_token_ids=[0]) for _ in range(self.batch_size)]


def test_recorder_times_steady_steps_and_profiles_a_window_of_them():
    runtime = _FakeRuntime(3, 12)
    cpu_only = (torch.profiler.ProfilerActivity.CPU,)
    with StepRecorder(runtime, 3, max_tokens=12, profile_steps=4, profiler_activities=cpu_only) as recorder:
        for _ in range(12):
            runtime.step()
    assert "step" not in vars(runtime)  # unwrapped
    assert [r.num_first_tokens for r in recorder.records[:2]] == [3, 0]
    assert [r.profiled for r in recorder.records] == [False] * 3 + [True] * 4 + [False] * 5
    assert len(recorder.steady_records()) == 11 - 4
    assert recorder.profiled_wall > 0
    # Only CPU activity recorded: no GPU interval, so the "GPU" was idle throughout.
    assert recorder.busy_per_step == 0.0
    assert recorder.profiled_idle_share == pytest.approx(1.0)
    assert recorder.kernel_table == []


def test_kernel_table_groups_activities_by_name_per_step():
    activities = [("gemm", 0, 30), ("norm", 30, 40), ("gemm", 50, 80), ("norm", 80, 90), ("gemm", 100, 120)]
    table = kernel_table(activities, steps=2)
    assert [k["name"] for k in table] == ["gemm", "norm"]
    assert table[0]["launches_per_step"] == 1.5 and table[0]["us_per_step"] == pytest.approx(40e-3)
    assert table[1]["launches_per_step"] == 1.0 and table[1]["us_per_step"] == pytest.approx(10e-3)
    assert table[0]["share"] == pytest.approx(0.8) and table[1]["share"] == pytest.approx(0.2)
