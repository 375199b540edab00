"""PNG plots of ``freetoken bench --json`` results: decode ms/step (with the HBM floor) and the
ratio to the floor, against batch size. Several JSON files are drawn as several series.

    python -m freetoken.bench.plot results.json [other.json ...] --out docs/img/bench

Needs matplotlib (``pip install freetoken[bench]``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _series(results: list[dict[str, Any]], *keys: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for result in results:
        value: Any = result
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            xs.append(result["batch_size"])
            ys.append(value)
    return xs, ys


def plot(reports: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write ``decode_ms_per_step.png`` and ``ratio_to_floor.png`` into ``out_dir``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {
        "decode_ms_per_step.png": ("decode ms / step", ("decode_ms_per_step",), ("floor", "ms")),
        "ratio_to_floor.png": ("decode time / HBM floor", ("ratio_to_floor",), None),
    }
    written = []
    for filename, (ylabel, key, floor_key) in figures.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, report in reports.items():
            results = report["results"]
            ax.plot(*_series(results, *key), marker="o", label=f"FreeToken {label}")
            hf_x, hf_y = _series(results, "transformers", *key)
            if hf_y:
                ax.plot(hf_x, hf_y, marker="s", label=f"transformers {label}")
            if floor_key:
                ax.plot(*_series(results, *floor_key), linestyle="--", color="gray", label=f"HBM floor {label}")
        if floor_key is None:
            ax.axhline(1.0, linestyle="--", color="gray", label="floor")
        batch_sizes = sorted({r["batch_size"] for report in reports.values() for r in report["results"]})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size (requests decoding)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freetoken.bench.plot", description=__doc__.splitlines()[0])
    parser.add_argument("json_files", nargs="+", type=Path, help="outputs of freetoken bench --json")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the PNGs (default: .)")
    args = parser.parse_args(argv)
    reports = {path.stem: json.loads(path.read_text()) for path in args.json_files}
    for path in plot(reports, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
