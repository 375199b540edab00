#!/usr/bin/env bash
# The GPU check, for one NVIDIA GPU with torch + Triton installed (the lent H200 machine):
#   1. tests/gpu (pytest -m gpu): every Triton kernel against its torch reference at the real model
#      sizes, and float32 end-to-end greedy parity with transformers on CUDA;
#   2. tests/kernels compiled on the GPU (the CI kernel suite at small odd sizes, CPU e2e test too);
#   3. kernel timings against the measured hardware floor (benchmarks/kernels.py).
# Logs go under $OUT (default /tmp/freetoken-gpu); a summary table is printed last.
# GPU_TESTS (default: tests/gpu; e.g. "-n 6 tests/gpu" with pytest-xdist) and KERNEL_TESTS
# (default: tests/kernels; "none" skips the stage) narrow a re-run to what changed; BENCH=none
# skips the timings. Each stage is cut after its limit in seconds: GPU_TESTS_TIMEOUT (900: the
# whole of tests/gpu, compiles included, under -n 6 or serially), KERNEL_TESTS_TIMEOUT (600),
# BENCH_TIMEOUT (300). At its limit a stage gets SIGINT, so pytest still writes its report and
# junit XML (which tests failed, which were not reached), and SIGKILL 30 s later. A caller with a
# shorter wall-clock limit should lower them so the summary still prints.
# FreeToken is used from this checkout (scripts/gpu_site.sh: copied into a site folder, no build).
# A newer transformers can travel as a wheel in .whl/ (git-ignored): it is installed first when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/freetoken-gpu}
mkdir -p "$OUT"
GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-900}
KERNEL_TESTS_TIMEOUT=${KERNEL_TESTS_TIMEOUT:-600}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
GPU_SITE_LOG="$OUT/setup.log"
source scripts/gpu_site.sh
python3 - <<'PY' 2>&1 | tee "$OUT/versions.log"
import torch, triton, transformers, freetoken
print(f"python torch {torch.__version__} triton {triton.__version__} transformers {transformers.__version__}")
print(f"device {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
print(f"freetoken from {freetoken.__file__}")
PY
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/versions.log"

# stage LIMIT LOG COMMAND...: COMMAND's output to LOG, cut (SIGINT, then SIGKILL) after LIMIT seconds.
stage() {
    local limit=$1 log=$2
    shift 2
    timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee "$log"
    if [ "${PIPESTATUS[0]}" = 124 ]; then echo "stage cut at its limit of ${limit}s: $*" | tee -a "$log"; fi
}

rm -f "$OUT/errors.jsonl" "$OUT/gpu-junit.xml" "$OUT/kernels-junit.xml"
FREETOKEN_GPU_REPORT="$OUT/errors.jsonl" stage "$GPU_TESTS_TIMEOUT" "$OUT/pytest-gpu.log" python3 -m pytest ${GPU_TESTS:-tests/gpu} -m gpu -q -rfE \
    -p no:cacheprovider --junitxml="$OUT/gpu-junit.xml"
if [ "${KERNEL_TESTS:-tests/kernels}" != none ]; then
    stage "$KERNEL_TESTS_TIMEOUT" "$OUT/pytest-kernels.log" python3 -m pytest ${KERNEL_TESTS:-tests/kernels} -q -rfE \
        -p no:cacheprovider --junitxml="$OUT/kernels-junit.xml"
fi
if [ "${BENCH:-yes}" != none ]; then
    stage "$BENCH_TIMEOUT" "$OUT/bench.log" python3 benchmarks/kernels.py --json "$OUT/bench.json"
fi

python3 - "$OUT" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
print("\n==== SUMMARY ====")
for name in ("gpu-junit.xml", "kernels-junit.xml"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        print(f"{name}: missing (stage skipped, crashed or cut by its *_TIMEOUT)")
        continue
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    a = suite.attrib
    print(f"{name}: {a['tests']} tests, {a['failures']} failures, {a['errors']} errors, {a['skipped']} skipped, {float(a['time']):.0f}s")
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            print(f"   FAILED {case.attrib['name']}")
path = os.path.join(out, "errors.jsonl")
if os.path.exists(path):
    worst = {}
    for line in open(path):
        r = json.loads(line)
        key = (r["name"], r["dtype"])
        worst[key] = max(worst.get(key, (0.0, r["bound"]))[0], r["rel_error"]), r["bound"]
    print("| kernel | dtype | max rel L2 error | bound |")
    for (n, d), (e, b) in sorted(worst.items()):
        print(f"| {n} | {d} | {e:.2e} | {b:.0e} |")
print(open(os.path.join(out, "bench.log")).read().split("measured ceilings")[-1] if os.path.exists(os.path.join(out, "bench.log")) else "no bench")
PY
