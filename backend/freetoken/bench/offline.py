"""``freetoken bench``: offline decode latency and throughput through ``LLM.generate``, against the
HBM floor, per batch size.

For each batch size ``B``: ``B`` random prompts of ``input_len`` tokens, greedy, ``output_len``
tokens each (EOS ignored). A short warm-up run first (kernels compile), then the timed run, whose
every engine step is timed (``bench.timing``):

- decode ms/step: the median over steady decode steps (all ``B`` requests decoding), tok/s
  ``B / step``;
- TTFT: request arrival to first token (mean and max); prefill tok/s: ``B · input_len / max TTFT``
  (decodes of requests done with their prompt run in the same steps);
- the HBM floor at the steady steps' mean context (``bench.floor``) and the ratio to it;
- the GPU idle share over a few steady steps (CUDA only);
- with ``--moe-offload``: the expert cache over the timed run (hits, misses, hit rate, bytes
  copied, and their PCIe floor: bytes / ``--pcie-bandwidth`` per decode step), and split into the
  prefill steps and the steady decode steps, with every step's counters (``bench.offload_stats``);
  with ``--resident-ms-per-step`` (the all-resident run's figure) also the share of its tokens/s
  and the time added per step against the missed experts' PCIe floor. A steady state needs a few
  hundred decode steps (``--output-len 256``): the first ones after the prefill still fill the cache.

``--compare-transformers`` times transformers' ``generate()`` on a copy of the same weights.
``--workload shared-prefix`` times prefix-cache hits instead (``bench.shared_prefix``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from freetoken.bench.floor import DEFAULT_HBM_BANDWIDTH
from freetoken.bench.presets import PRESETS
from freetoken.bench.shared_prefix import DEFAULT_PROMPT_LEN, DEFAULT_SHARED_PREFIX_LEN, pages_needed

logger = logging.getLogger(__name__)

WARMUP_TOKENS = 8
PCIE_BANDWIDTH = 55e9  # pinned host -> device, measured on the H200 (issue 11)
DECODE_INPUT_LEN = 1024
WORKLOADS = ("decode", "shared-prefix")


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    """``freetoken bench`` options beside the engine's (standard library only: the CLI imports it)."""
    group = parser.add_argument_group("bench")
    group.add_argument("--workload", choices=WORKLOADS, default="decode",
                       help="decode: latency and throughput per batch size (default); shared-prefix: time to first "
                            "token with the prompt's first --shared-prefix-len tokens cached, against none cached")
    group.add_argument("--preset", choices=sorted(PRESETS), help="a real architecture with random weights (no --model)")
    group.add_argument("--num-layers", type=int, default=None, help="with --preset: keep the first N layers")
    group.add_argument("--batch-sizes", type=_int_list, default=[1, 16, 64, 128], help="comma-separated (1,16,64,128)")
    group.add_argument("--input-len", type=int, default=None,
                       help=f"prompt tokens per request ({DECODE_INPUT_LEN}; shared-prefix: {DEFAULT_PROMPT_LEN})")
    group.add_argument("--output-len", type=int, default=128, help="output tokens per request (128)")
    group.add_argument(
        "--hbm-bandwidth", type=float, default=DEFAULT_HBM_BANDWIDTH, help="bytes/s of the floor (4.3e12, H200)"
    )
    group.add_argument(
        "--pcie-bandwidth", type=float, default=PCIE_BANDWIDTH,
        help="host->device bytes/s of the expert copies' floor with --moe-offload (55e9, pinned, H200)",
    )
    group.add_argument(
        "--resident-ms-per-step", type=float, default=None, metavar="MS",
        help="with --moe-offload: the all-resident engine's decode ms/step (a run without --moe-offload, same "
             "flags): report the share of its tok/s and the time added per step against the missed experts' floor",
    )
    group.add_argument(
        "--profile-steps", type=int, default=5, help="steady steps profiled for the GPU idle share (5; 0: off)"
    )
    group.add_argument(
        "--quantization",
        choices=["none", "nvfp4"],
        default="none",
        help="with random weights: nvfp4 makes the linears an NVFP4 checkpoint quantizes (routed and shared "
        "experts, attention projections) random packed NVFP4 weights (none)",
    )
    group.add_argument(
        "--routing",
        choices=["uniform", "fitted", "trace"],
        default="uniform",
        help="with random weights: fitted biases the routers to the expert skew fitted to published Qwen3 "
        "routing (bench/routing_trace.py; what an expert cache sees; the floor still counts the experts uniform "
        "routing touches, exact at batch 1); trace (batch 1) drives them step by step along the fitted trace "
        "(bench/routing_trace.py's TraceRouting: corpus skew, a request skew per prompt and token persistence, "
        "realistic routing for an expert cache); uniform leaves them near uniform (uniform)",
    )
    group.add_argument("--compare-transformers", action="store_true", help="also time transformers' generate()")
    group.add_argument("--shared-prefix-len", type=int, default=DEFAULT_SHARED_PREFIX_LEN,
                       help=f"shared-prefix: prompt tokens a priming request caches first ({DEFAULT_SHARED_PREFIX_LEN})")
    group.add_argument("--prime-tail-len", type=int, default=0,
                       help="shared-prefix: tokens of its own after the priming request's prefix (0: the prefix alone)")
    group.add_argument("--repeats", type=int, default=3, help="shared-prefix: timed rounds after a warm-up one (3)")
    group.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write the results as JSON")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1, got {text!r}")
    return values


def _check(args: argparse.Namespace) -> None:
    if (args.preset is None) == (args.model is None):
        raise SystemExit("freetoken bench: give exactly one of --model DIR and --preset NAME")
    if args.num_layers is not None and args.preset is None:
        raise SystemExit("freetoken bench: --num-layers needs --preset")
    shared = args.workload == "shared-prefix"
    if args.input_len is None:
        args.input_len = DEFAULT_PROMPT_LEN if shared else DECODE_INPUT_LEN
    if args.routing == "trace" and max(args.batch_sizes) > 1:
        raise SystemExit("freetoken bench: --routing trace drives one request's routing: --batch-sizes 1 only")
    if args.routing != "uniform" and args.preset is None and args.load_format != "dummy":
        raise SystemExit("freetoken bench: --routing biases random routers: it needs --preset or --load-format dummy")
    if args.quantization != "none":
        if args.preset is None and args.load_format != "dummy":
            raise SystemExit(
                "freetoken bench: --quantization makes random quantized weights: it needs --preset or "
                "--load-format dummy (a checkpoint's own config says how it is quantized)"
            )
        if args.compare_transformers:
            raise SystemExit("freetoken bench: --compare-transformers runs dense weights: not with --quantization")
    if args.resident_ms_per_step is not None and (not args.moe_offload or args.resident_ms_per_step <= 0):
        raise SystemExit("freetoken bench: --resident-ms-per-step needs --moe-offload and a value > 0")
    if args.input_len < 1 or args.output_len < 2:
        raise SystemExit("freetoken bench: --input-len must be >= 1 and --output-len >= 2")
    if shared:
        if not 1 <= args.shared_prefix_len < args.input_len:
            raise SystemExit(f"freetoken bench: --shared-prefix-len must be in [1, --input-len {args.input_len}), "
                             f"got {args.shared_prefix_len}")
        if args.prime_tail_len < 0 or args.repeats < 1:
            raise SystemExit("freetoken bench: --prime-tail-len must be >= 0 and --repeats >= 1")
        if args.compare_transformers or args.routing != "uniform":
            raise SystemExit("freetoken bench: --compare-transformers and --routing are for the decode workload only")


def engine_config_for(args: argparse.Namespace, model_dir: str):
    """The engine flags, with what the bench needs: every batch running at once, and (unless given)
    only the KV pages the largest batch uses, so memory is left for transformers' model."""
    from freetoken.cli import engine_config_from_args

    config = engine_config_from_args(args)
    changes: dict[str, Any] = {"model": model_dir}
    if args.preset is not None:
        changes["load_format"] = "dummy"
    if args.workload == "shared-prefix":  # one request at a time; every round's prompts stay cached
        if config.num_pages is None:
            changes["num_pages"] = pages_needed(args.input_len, args.shared_prefix_len, args.prime_tail_len,
                                                args.repeats, config.page_size)
        return dataclasses.replace(config, **changes)
    largest = max(args.batch_sizes)
    if config.max_running_requests < largest:
        changes["max_running_requests"] = largest
    if config.num_pages is None:
        pages_per_request = math.ceil((args.input_len + args.output_len) / config.page_size)
        changes["num_pages"] = largest * (pages_per_request + 1) + 1
    return dataclasses.replace(config, **changes)


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(batch_size)]


def bench_batch(llm, batch_size: int, args: argparse.Namespace, traffic, progress) -> dict[str, Any]:
    """Warm up, then time one ``LLM.generate`` of ``batch_size`` requests."""
    from freetoken.bench.floor import decode_floor
    from freetoken.bench.timing import StepRecorder
    from freetoken.core import SamplingParams
    from freetoken.runtime import freeze_startup_objects

    prompts = random_prompts(batch_size, args.input_len, llm.runtime.engine.vocab_size, args.seed + batch_size)
    requests = [{"prompt_token_ids": p} for p in prompts]
    warmup = SamplingParams(temperature=0.0, max_tokens=min(WARMUP_TOKENS, args.output_len), ignore_eos=True)
    llm.generate(requests, warmup)
    llm.reset_prefix_cache()  # the timed run computes its prompts: the warm-up cached them
    freeze_startup_objects()  # what the warm-up left (captured graphs, compiled kernels), as a server after its warm-up
    progress.update(batch_size * warmup.max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    on_cuda = llm.runtime.engine.device.type == "cuda"
    memory = _MemoryWatch(on_cuda)
    cache_before = llm.runtime.stats().expert_cache
    offload = llm.runtime.engine.offload
    counters = None if offload is None else (lambda: dataclasses.asdict(offload.counters))
    timeline = None if offload is None else offload.record_timeline()  # CUDA: the prefill's per-layer events
    with StepRecorder(llm.runtime, batch_size, args.output_len, args.profile_steps if on_cuda else 0, progress,
                      counters=counters) as rec:
        outputs = llm.generate(requests, params)
    cache_after = llm.runtime.stats().expert_cache
    ttft = [o.metrics["time_to_first_token"] for o in outputs]
    steady = rec.steady_records()
    result: dict[str, Any] = {
        "batch_size": batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_prefill_length": llm.config.max_prefill_length,
        "steps": len(rec.records),
        "steady_steps": len(steady),
        "ttft_ms_mean": statistics.fmean(ttft) * 1e3,
        "ttft_ms_max": max(ttft) * 1e3,
        "prefill_tok_s": batch_size * args.input_len / max(ttft),
        "output_tok_s": batch_size * args.output_len / sum(r.seconds for r in rec.records),
        "gpu_idle_share": None,
        "profiled_idle_share": rec.profiled_idle_share,
        "gpu_busy_ms_per_step": rec.busy_per_step * 1e3 if rec.busy_per_step is not None else None,
        "kernels": rec.kernel_table,
        **memory.result(),
        "profiled_ms_per_step": rec.profiled_wall / args.profile_steps * 1e3 if rec.profiled_wall else None,
        "decode_ms_per_step": None,
        "decode_ms_p90": None,
        "decode_tok_s": None,
        "floor": None,
        "ratio_to_floor": None,
        "expert_cache": _expert_cache_delta(cache_before, cache_after, len(rec.records), args.pcie_bandwidth,
                                            _expert_bytes(llm)),
        "expert_cache_phases": None,
    }
    if offload is not None:
        from freetoken.bench.offload_stats import expert_cache_phases

        result["expert_cache_phases"] = expert_cache_phases(
            rec.records, rec.steady_records(profiled=True), steady, offload.expert_bytes, args.pcie_bandwidth,
            args.resident_ms_per_step,
        )
        if timeline is not None:
            offload.stop_timeline()
            result["expert_cache_phases"]["timelines"] = timeline.summary()
    if steady:
        step_s = statistics.median(r.seconds for r in steady)
        context = args.input_len + statistics.fmean(r.mean_output_len for r in steady) - 1
        floor = decode_floor(traffic, batch_size, context, args.hbm_bandwidth)
        result.update(
            decode_ms_per_step=step_s * 1e3,
            decode_ms_p90=_quantile([r.seconds for r in steady], 0.9) * 1e3,
            decode_tok_s=batch_size / step_s,
            floor=floor.as_dict(),
            ratio_to_floor=step_s / floor.seconds,
        )
        if rec.busy_per_step is not None:  # against the unprofiled step (bench.timing)
            result["gpu_idle_share"] = max(0.0, 1.0 - rec.busy_per_step / step_s)
    else:
        logger.warning("batch %d: no steady decode step (raise --output-len)", batch_size)
    return result


def _expert_bytes(llm) -> int:
    offload = llm.runtime.engine.offload
    return 0 if offload is None else offload.expert_bytes


def _expert_cache_delta(before, after, steps: int, pcie_bandwidth: float, expert_bytes: int) -> dict[str, Any] | None:
    """The expert cache over the timed run (None: experts resident). Two PCIe floors per step: of
    the bytes copied into the cache, and of the missed experts' bytes (issue 11's floor: a zero-copy
    decode miss reads its expert over PCIe in the step, at batch 1 once; the copy that follows adds
    ``bytes_copied``)."""
    if after is None:
        return None
    hits, misses = after.hits - before.hits, after.misses - before.misses
    copied = after.bytes_copied - before.bytes_copied
    prefetched = after.prefetched - before.prefetched
    return {
        "slots": after.slots,
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "bytes_copied": copied,
        "prefetched": prefetched,
        "prefetch_hits": after.prefetch_hits - before.prefetch_hits,
        "copy_floor_ms_per_step": copied / pcie_bandwidth / steps * 1e3 if steps else None,
        "miss_floor_ms_per_step": misses * expert_bytes / pcie_bandwidth / steps * 1e3 if steps else None,
    }


class _MemoryWatch:
    """CUDA memory of the timed run beyond what was allocated before it (weights, KV pool, states):
    the activations' peak, allocated and reserved by the caching allocator (the largest prefill
    chunk's: a decode step's activations are far smaller, so this is the ``--max-prefill-length``
    trade-off's memory side), and the allocator's retries (a retry frees cached blocks and
    synchronises: the stalls long prefill chunks can cause)."""

    def __init__(self, on_cuda: bool) -> None:
        import torch

        self.on_cuda = on_cuda
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
            self.reserved_before = torch.cuda.memory_reserved()
            self.retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)

    def result(self) -> dict[str, Any]:
        import torch

        if not self.on_cuda:
            return {"activation_peak_mib": None, "activation_peak_reserved_mib": None, "alloc_retries": None}
        return {
            "activation_peak_mib": (torch.cuda.max_memory_allocated() - self.before) / 2**20,
            "activation_peak_reserved_mib": (torch.cuda.max_memory_reserved() - self.reserved_before) / 2**20,
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - self.retries,
        }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_transformers(hf_model, batch_size: int, args: argparse.Namespace, vocab_size: int, floor_ms: float | None):
    import torch

    from freetoken.bench.transformers_compare import time_transformers

    prompts = random_prompts(batch_size, args.input_len, vocab_size, args.seed + batch_size)
    try:
        timing = time_transformers(hf_model, prompts, args.output_len)
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {"error": f"out of memory: {exc}".splitlines()[0]}
    decode_ms = timing.decode_ms_per_step(args.output_len)
    return {
        "decode_ms_per_step": decode_ms,
        "decode_tok_s": batch_size / decode_ms * 1e3,
        "ttft_ms": timing.prefill_seconds * 1e3,
        "prefill_tok_s": batch_size * args.input_len / timing.prefill_seconds,
        "ratio_to_floor": decode_ms / floor_ms if floor_ms else None,
    }


def run_bench(args: argparse.Namespace) -> int:
    _check(args)
    json_path = Path(args.json_path) if args.json_path else None
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="freetoken-bench-") as scratch:
        model_dir = args.model
        if args.preset is not None:
            from freetoken.bench.presets import write_preset_dir

            model_dir = str(write_preset_dir(args.preset, scratch, args.num_layers))
        if args.quantization == "nvfp4":
            from freetoken.bench.presets import copy_config_dir, write_nvfp4_config

            if args.preset is None:
                model_dir = str(copy_config_dir(model_dir, Path(scratch) / "model"))
            write_nvfp4_config(model_dir)
        run = _run_shared_prefix if args.workload == "shared-prefix" else _run
        report = run(args, engine_config_for(args, model_dir), json_path)
    from freetoken.bench.report import print_report, print_shared_prefix

    (print_shared_prefix if args.workload == "shared-prefix" else print_report)(report)
    if json_path is not None:
        print(f"wrote {json_path}", file=sys.stderr)
    return 0


def _report_header(args: argparse.Namespace, llm, config) -> dict[str, Any]:
    """What was run, on what: the start of every report."""
    import torch
    import transformers

    from freetoken.bench.floor import parameter_count

    engine = llm.runtime.engine
    return {
        "args": {name: value for name, value in vars(args).items() if name != "run"},
        "workload": args.workload,
        "preset": args.preset,
        "model": args.model,
        "num_layers": len(engine.model.layers),
        "num_parameters": parameter_count(engine.model),
        "weight_bytes": sum(p.nbytes for p in engine.model.parameters()),
        "quantization": args.quantization,
        "routing": args.routing,
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hbm_bandwidth": args.hbm_bandwidth,
        "engine_config": dataclasses.asdict(config),
    }


def _run_shared_prefix(args: argparse.Namespace, config, json_path: Path | None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from freetoken.bench.shared_prefix import bench_shared_prefix
    from freetoken.llm import LLM

    llm = LLM(**dataclasses.asdict(config))
    report = _report_header(args, llm, config)
    with tqdm(total=args.repeats + 1, desc="freetoken bench (shared prefix)", unit="round") as progress:
        report["shared_prefix"] = bench_shared_prefix(llm, args.input_len, args.shared_prefix_len, args.prime_tail_len,
                                                      args.repeats, args.seed, progress)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _run(args: argparse.Namespace, config, json_path: Path | None) -> dict[str, Any]:
    """Every batch size in turn; the JSON is rewritten after each, so a run cut short keeps its results."""
    from tqdm.auto import tqdm

    from freetoken.bench.floor import decode_traffic_of
    from freetoken.llm import LLM

    llm = LLM(**dataclasses.asdict(config))
    engine = llm.runtime.engine
    model = engine.model
    if args.routing == "fitted":
        from freetoken.bench.routing_trace import bias_routers

        bias_routers(model, args.seed)
        if engine.graph_runner is not None:
            engine.graph_runner.capture()  # the graphs of the start ran the routers unbiased
    elif args.routing == "trace":
        from freetoken.bench.routing_trace import TraceRouting

        driver = TraceRouting(model, args.seed)
        launch = engine.launch

        def driven(plan):
            driver.before(plan)
            return launch(plan)

        engine.launch = driven  # every step's routing set before it is queued
        if engine.graph_runner is not None:
            engine.graph_runner.capture()  # the graphs read the routers' new bias buffer
    traffic = decode_traffic_of(model)
    hf_model = None
    if args.compare_transformers:
        from freetoken.bench.transformers_compare import transformers_model_of

        hf_model = transformers_model_of(model, engine.loaded.config, engine.loaded.dtype)
    report = {**_report_header(args, llm, config), "results": []}
    hf_tokens = args.output_len + 3 if hf_model is not None else 0  # warm-up (2), prefill (1), timed run
    per_batch = min(WARMUP_TOKENS, args.output_len) + args.output_len + hf_tokens
    with tqdm(total=sum(args.batch_sizes) * per_batch, desc="freetoken bench", unit="tok") as progress:
        for batch_size in args.batch_sizes:
            progress.set_postfix(batch=batch_size)
            result = bench_batch(llm, batch_size, args, traffic, progress)
            if hf_model is not None:
                floor_ms = result["floor"]["ms"] if result["floor"] else None
                result["transformers"] = bench_transformers(hf_model, batch_size, args, engine.vocab_size, floor_ms)
                progress.update(batch_size * hf_tokens)
            report["results"].append(result)
            if json_path is not None:
                json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
