"""Turn benchmark JSON (a folder of benchmarks/results/, or chosen files) into PNGs.

    python benchmarks/plot.py --results benchmarks/results/DIR [--out DIR]   (default: --out = --results)
    python benchmarks/plot.py --results FILE.json [FILE.json ...] --out DIR

Reads every *.json of each folder given, and each file given, and writes:

- ``requests_per_s.png``: a group of bars per model and system-prompt length P, a bar per system: the
  same requests with no system prompt on vLLM's default, relay, vLLM's default (its prefix cache) and
  SGLang (its radix cache). From `bench_throughput.py` files (``{"args": {"prefix_len": P, "model":
  ...}, CONFIG: {"single": {"requests_per_s": ...}}}``, or the older flat ``CONFIG: {"requests_per_s":
  ...}``), configs ``noprefix``, ``relay``, ``default`` and ``sglang``. A configuration's value in one
  file is the median of its runs (``runs_requests_per_s``, else ``requests_per_s``); a bar is the
  median over the files that give it. Groups with one bar are left out.
- ``<name>.png`` for each serving-benchmark file ``<name>.json``: TTFT, TPOT and end-to-end latency
  (p50 solid, p99 dashed) and achieved requests/s against the Poisson request rate, one line per
  configuration. Expected shape::

      {"model": str,
       "configs": {NAME: [{"rate": float,                      # requests/s offered
                           "ttft_ms": {"p50": float, "p99": float},
                           "tpot_ms": {"p50": float, "p99": float},
                           "e2e_ms": {"p50": float, "p99": float},
                           "req_per_s": float}, ...]}}        # achieved; one row per rate

``--figures`` picks the kinds to write (default: both). Other JSON (accuracy, kernel benchmarks) is
ignored. A plot without data is skipped with a message saying what is missing; the script fails only
on a file that claims a shape and breaks it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
THROUGHPUT_PNG = "requests_per_s.png"
LATENCIES = (
    ("ttft_ms", "time to first token (ms)"),
    ("tpot_ms", "time per output token (ms)"),
    ("e2e_ms", "end-to-end latency (ms)"),
)
COLORS = {"relay": "tab:blue", "default": "tab:orange", "noprefix": "tab:gray", "sglang": "tab:green"}
SYSTEMS = (  # config in a throughput file, bar label
    ("noprefix", "no system prompt (vLLM default)"),
    ("relay", "relay"),
    ("default", "vLLM default (prefix caching)"),
    ("sglang", "SGLang (radix cache)"),
)
FIGURES = ("throughput", "serving")


def model_label(path: str) -> str:
    """A model folder's name without the fixture cache's hash suffix."""
    return re.sub(r"-[0-9a-f]{10}$", "", Path(path).name)


def rps(entry: dict) -> float | None:
    """Requests/s of one configuration's entry (the single-prompt workload's, or the flat field):
    the median of its runs where the file lists them, else ``requests_per_s``."""
    if "requests_per_s" not in entry:
        entry = entry.get("single")
        if not isinstance(entry, dict) or "requests_per_s" not in entry:
            return None
    runs = entry.get("runs_requests_per_s")
    return float(statistics.median(runs)) if runs else float(entry["requests_per_s"])


def json_files(paths: list[Path]) -> list[Path]:
    """Each folder's *.json, sorted, and each file as given."""
    return [f for p in paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]


def load(results: Path | list[Path]) -> tuple[list[tuple[Path, dict]], list[tuple[Path, dict]]]:
    """(throughput files, serving files) found in `results`: folders and files."""
    throughput, serving = [], []
    for path in json_files(results if isinstance(results, list) else [results]):
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            continue
        if isinstance(data.get("configs"), dict):
            serving.append((path, data))
        elif (
            isinstance(data.get("args"), dict)
            and "prefix_len" in data["args"]
            and any(isinstance(v, dict) and rps(v) is not None for v in data.values())
        ):
            throughput.append((path, data))
    return throughput, serving


def throughput_bars(files: list[tuple[Path, dict]]) -> dict[tuple[str, int], dict[str, float]]:
    """{(model, P): {config: requests/s}} for the configs of SYSTEMS, each the median over the files
    giving it, sorted by model and P; a group with one system is left out."""
    values: dict[tuple[str, int], dict[str, list[float]]] = {}
    for _path, data in files:
        group = (model_label(data["args"]["model"]), int(data["args"]["prefix_len"]))
        for config, _ in SYSTEMS:
            if config in data and rps(data[config]) is not None:
                values.setdefault(group, {}).setdefault(config, []).append(rps(data[config]))
    return {g: {c: statistics.median(v) for c, v in configs.items()}
            for g, configs in sorted(values.items()) if len(configs) > 1}


def plot_throughput(files: list[tuple[Path, dict]], out: Path) -> Path | None:
    """``requests_per_s.png``: each group's bars, centred on its tick."""
    groups = throughput_bars(files)
    if not groups:
        print(f"[plot] skip {THROUGHPUT_PNG}: no bench_throughput.py results with two systems at one model "
              "and system-prompt length")
        return None
    import matplotlib.pyplot as plt

    width = 0.8 / max(len(systems) for systems in groups.values())
    fig, ax = plt.subplots(figsize=(2.2 + 2.4 * len(groups), 4))
    labelled = set()
    for j, systems in enumerate(groups.values()):
        present = [(c, label) for c, label in SYSTEMS if c in systems]
        for i, (config, label) in enumerate(present):
            x, y = j + (i - (len(present) - 1) / 2) * width, systems[config]
            ax.bar(x, y, width, color=COLORS[config], label=None if config in labelled else label)
            ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
            labelled.add(config)
    ax.set_xticks(range(len(groups)), [f"{model}\nP = {P}" for model, P in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylim(0, 1.25 * max(max(systems.values()) for systems in groups.values()))
    ax.set_ylabel("throughput (requests/s)")
    ax.set_title("Requests behind one system prompt of P tokens", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper right", ncols=2)
    fig.tight_layout()
    path = out / THROUGHPUT_PNG
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def check_serving(path: Path, data: dict) -> None:
    for name, rows in data["configs"].items():
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{path}: configs[{name!r}] must be a non-empty list of rows")
        for row in rows:
            missing = [k for k in ("rate", "req_per_s", *(m for m, _ in LATENCIES)) if k not in row]
            missing += [
                f"{m}.{q}" for m, _ in LATENCIES if m in row for q in ("p50", "p99") if q not in row[m]
            ]
            if missing:
                raise ValueError(f"{path}: configs[{name!r}] row {row.get('rate')!r} lacks {missing}")


def plot_serving(path: Path, data: dict, out: Path) -> Path:
    import matplotlib.pyplot as plt

    check_serving(path, data)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for i, (name, rows) in enumerate(sorted(data["configs"].items())):
        rows = sorted(rows, key=lambda r: r["rate"])
        rates = [r["rate"] for r in rows]
        color = COLORS.get(name, f"C{i}")
        for ax, (metric, label) in zip(axes, LATENCIES):
            ax.plot(rates, [r[metric]["p50"] for r in rows], "o-", color=color, label=f"{name} p50")
            ax.plot(
                rates, [r[metric]["p99"] for r in rows], "s--", color=color, alpha=0.6, label=f"{name} p99"
            )
            ax.set_ylabel(label)
        axes[3].plot(rates, [r["req_per_s"] for r in rows], "o-", color=color, label=name)
    axes[3].plot(axes[3].get_xlim(), axes[3].get_xlim(), ":", color="black", alpha=0.4, label="offered")
    axes[3].set_ylabel("achieved requests/s")
    for ax in axes:
        ax.set_xlabel("request rate (requests/s, Poisson)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Latency vs request rate ({model_label(str(data.get('model', '?')))})", fontsize=10)
    fig.tight_layout()
    png = out / f"{path.stem}.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, nargs="+", default=[RESULTS],
                   help="folders (every *.json in each) and JSON files")
    p.add_argument("--out", type=Path, help="default: the first results folder (or the first file's folder)")
    p.add_argument("--figures", nargs="+", choices=FIGURES, default=list(FIGURES), help="which kinds to write")
    args = p.parse_args(argv)
    first = args.results[0]
    out = args.out or (first if first.is_dir() else first.parent)
    out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    throughput, serving = load(args.results)
    written = [plot_throughput(throughput, out)] if "throughput" in args.figures else []
    if "serving" in args.figures and not serving:
        print(
            f'[plot] skip the latency plots: no serving benchmark JSON ({{"model", "configs": ...}}) '
            "among the results given"
        )
    if "serving" in args.figures:
        written += [plot_serving(path, data, out) for path, data in serving]
    for png in filter(None, written):
        print(f"[plot] wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
