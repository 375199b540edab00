"""The bench results as a table on stdout (the JSON has everything)."""

from __future__ import annotations

from typing import Any

GB = 1e9


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(result: dict[str, Any]) -> list[str]:
    floor = result["floor"]
    idle = result["gpu_idle_share"]
    row = [
        str(result["batch_size"]),
        _num(result["decode_ms_per_step"], ".2f"),
        _num(result["decode_tok_s"], ",.0f"),
        _num(result["prefill_tok_s"], ",.0f"),
        _num(result["ttft_ms_max"], ",.1f"),
    ]
    if floor:
        row += [
            f"{floor['ms']:.2f}",
            f"{floor['non_expert_weight_bytes'] / GB:.2f}",
            f"{floor['expert_weight_bytes'] / GB:.2f} ({floor['experts_per_layer']:.0f}/layer)",
            f"{floor['kv_bytes'] / GB:.3f}",
            f"{floor['state_bytes'] / GB:.3f}",
        ]
    else:
        row += ["-"] * 5
    row += [_num(result["ratio_to_floor"], ".2f"), "-" if idle is None else f"{100 * idle:.1f}%"]
    row += [
        str(result.get("max_prefill_length", "-")),
        f"{_num(result.get('activation_peak_mib'), ',.0f')} / {_num(result.get('activation_peak_reserved_mib'), ',.0f')}",
        _num(result.get("alloc_retries"), "d"),
    ]
    hf = result.get("transformers")
    if hf is not None and "error" in hf:
        row += [hf["error"][:24], "-"]
    elif hf is not None:
        row += [_num(hf["decode_ms_per_step"], ".2f"), _num(hf["ratio_to_floor"], ".1f")]
    return row


HEADER = [
    "batch",
    "decode ms/step",
    "decode tok/s",
    "prefill tok/s",
    "TTFT ms (max)",
    "floor ms",
    "weights GB",
    "experts GB",
    "KV GB",
    "state GB",
    "x floor",
    "GPU idle",
    "chunk",
    "act. peak MiB (alloc / reserved)",
    "alloc retries",
]


KERNELS_SHOWN = 25


def print_kernel_table(result: dict[str, Any]) -> None:
    """The profiled steady steps' GPU activities by name: launches and µs per step, share."""
    table = result.get("kernels")
    if not table:
        return
    launches = sum(k["launches_per_step"] for k in table)
    total_us = sum(k["us_per_step"] for k in table)
    busy = result.get("gpu_busy_ms_per_step")
    union = "" if busy is None else f" ({busy:.2f} ms with the GPU busy: overlapping activities count once)"
    print(f"batch {result['batch_size']}: {launches:.0f} GPU activities, {total_us / 1e3:.2f} ms of activity per step{union}")
    print(f"  {'launches':>8}  {'us/step':>9}  {'share':>6}  kernel")
    for k in table[:KERNELS_SHOWN]:
        print(f"  {k['launches_per_step']:8.1f}  {k['us_per_step']:9.1f}  {100 * k['share']:5.1f}%  {k['name'][:100]}")
    if len(table) > KERNELS_SHOWN:
        rest = table[KERNELS_SHOWN:]
        print(
            f"  {sum(k['launches_per_step'] for k in rest):8.1f}  {sum(k['us_per_step'] for k in rest):9.1f}  "
            f"{100 * sum(k['share'] for k in rest):5.1f}%  ({len(rest)} more)"
        )


def print_expert_cache(result: dict[str, Any]) -> None:
    """With --moe-offload: the expert cache over the timed run."""
    cache = result.get("expert_cache")
    if not cache:
        return
    print(
        f"batch {result['batch_size']}: expert cache of {cache['slots']} slots: hit rate "
        f"{_num(None if cache['hit_rate'] is None else 100 * cache['hit_rate'], '.1f')}% "
        f"({cache['hits']:,} hits, {cache['misses']:,} misses; the whole timed run, prefill included), "
        f"{cache['bytes_copied'] / GB:.2f} GB copied "
        f"(PCIe floor {_num(cache['copy_floor_ms_per_step'], '.2f')} ms/step; of the missed experts' bytes "
        f"{_num(cache.get('miss_floor_ms_per_step'), '.2f')} ms/step), prefetched {cache['prefetched']:,} "
        f"({cache['prefetch_hits']:,} used)"
    )


def print_report(report: dict[str, Any]) -> None:
    results = report["results"]
    header = HEADER + (["HF ms/step", "HF x floor"] if any("transformers" in r for r in results) else [])
    rows = [header] + [format_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    name = report["preset"] or report["model"]
    quantized = "" if report.get("quantization", "none") == "none" else f" ({report['quantization']} linears)"
    weights = f", {report['weight_bytes'] / GB:.2f} GB of weights" if "weight_bytes" in report else ""
    print(
        f"{name}: {report['num_layers']} layers, {report['num_parameters'] / 1e9:.2f}B parameters{weights}, "
        f"{report['dtype']}{quantized} on {report['device']}; floor at {report['hbm_bandwidth'] / 1e12:.2f} TB/s"
    )
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    for result in results:
        print_expert_cache(result)
        if result.get("expert_cache_phases"):
            from freetoken.bench.offload_stats import print_phases

            print_phases(result["batch_size"], result["expert_cache_phases"])
    for result in results:
        print_kernel_table(result)


def print_shared_prefix(report: dict[str, Any]) -> None:
    """The shared-prefix workload: both TTFTs, their ratio and what the cache held."""
    r = report["shared_prefix"]
    name = report["preset"] or report["model"]
    caching = "on" if r["prefix_caching"] else "off"
    print(
        f"{name}: {report['num_layers']} layers, {report['dtype']} on {report['device']}; prefix caching {caching}; "
        f"{r['prompt_len']}-token prompts, the first {r['shared_prefix_len']} shared; median of {r['repeats']} rounds"
    )
    print(f"  TTFT uncached      {r['ttft_ms_uncached']:10.2f} ms  ({r['prefill_tok_s_uncached']:,.0f} prompt tok/s)")
    print(f"  TTFT cached        {r['ttft_ms_cached']:10.2f} ms  ({r['prefill_tok_s_cached']:,.0f} tok/s prefilled)")
    print(f"  cached / uncached  {r['ttft_ratio']:10.3f}")
    print(f"  num_cached_tokens  {r['num_cached_tokens']:10d}  (of {r['cacheable_tokens']} in whole pages)")
