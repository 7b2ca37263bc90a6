"""Turn benchmark JSON (a folder of benchmarks/results/, or chosen files) into PNGs.

    python benchmarks/plot.py --results benchmarks/results/DIR [--out DIR]   (default: --out = --results)
    python benchmarks/plot.py --results FILE.json [FILE.json ...] --out DIR

Reads every *.json of each folder given, and each file given, and writes:

- ``throughput_vs_prompt_len_<model>.png``: requests/s against the system-prompt length P, for relay
  and vLLM's default, with the no-system-prompt ceiling, one per model. From `bench_throughput.py`
  files (``{"args": {"prefix_len": P, "model": ...}, CONFIG: {"single": {"requests_per_s": ...}}}``,
  or the older flat ``CONFIG: {"requests_per_s": ...}``, used only for models without newer files): configs
  ``relay`` and ``default`` at P = args.prefix_len; ``noprefix-relay`` and ``noprefix`` (the same
  requests without the shared prefix) are relay and vLLM's default at P = 0 (the latter only when
  vLLM's default has other points); ``noprefix`` is also the ceiling line. A configuration's value in
  one file is the median of its runs (``runs_requests_per_s``, else ``requests_per_s``); where several
  files give one point (or the ceiling), the plot shows the median over the files.
- ``<name>.png`` for each serving-benchmark file ``<name>.json``: TTFT, TPOT and end-to-end latency
  (p50 solid, p99 dashed) and achieved requests/s against the Poisson request rate, one line per
  configuration. Expected shape::

      {"model": str,
       "configs": {NAME: [{"rate": float,                      # requests/s offered
                           "ttft_ms": {"p50": float, "p99": float},
                           "tpot_ms": {"p50": float, "p99": float},
                           "e2e_ms": {"p50": float, "p99": float},
                           "req_per_s": float}, ...]}}        # achieved; one row per rate

- ``requests_per_s_p<P>.png``: from the same files, one bar per system (no system prompt, relay,
  vLLM's default, SGLang: configs ``noprefix``, ``relay``, ``default``, ``sglang``) and model at each
  system-prompt length P > 0 where a model has two of them; each bar the median over the files.

``--figures`` picks which of the three kinds to write (default: all).
Other JSON (accuracy, kernel benchmarks) is ignored. A plot without data is skipped with a message
saying what is missing; the script fails only on a file that claims a shape and breaks it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
THROUGHPUT_PNG = "throughput_vs_prompt_len.png"
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
FIGURES = ("throughput", "systems", "serving")


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


def by_model(files: list[tuple[Path, dict]]) -> dict[str, list[tuple[Path, dict]]]:
    """Throughput files per model; a model's newer (per-workload) files replace its flat ones."""
    groups: dict[str, list[tuple[Path, dict]]] = {}
    for path, data in files:
        groups.setdefault(model_label(data["args"]["model"]), []).append((path, data))
    for label, group in groups.items():
        newer = [(p, d) for p, d in group if any(isinstance(v, dict) and "single" in v for v in d.values())]
        if newer:
            groups[label] = newer
    return groups


def throughput_points(
    files: list[tuple[Path, dict]],
) -> tuple[dict[str, dict[int, float]], float | None, str]:
    """({"relay"|"default": {P: requests/s}}, ceiling requests/s or None, workload label); medians
    over the files where several give one point."""
    values: dict[str, dict[int, list[float]]] = {"relay": {}, "default": {}}
    ceiling, workloads = [], set()
    for _path, data in files:
        a = data["args"]
        P = int(a["prefix_len"])
        workloads.add(
            f"{model_label(a['model'])}, {a.get('input_len', '?')} in / {a.get('output_len', '?')} out"
        )
        for config, (name, at) in {
            "relay": ("relay", P),
            "default": ("default", P),
            "noprefix-relay": ("relay", 0),
        }.items():
            if config in data and rps(data[config]) is not None:
                values[name].setdefault(at, []).append(rps(data[config]))
        if "noprefix" in data and rps(data["noprefix"]) is not None:
            ceiling.append(rps(data["noprefix"]))
    series = {name: {at: statistics.median(v) for at, v in points.items()} for name, points in values.items()}
    median = statistics.median(ceiling) if ceiling else None
    if median is not None and series["default"]:  # vLLM's default with no system prompt is the ceiling
        series["default"][0] = median
    return series, median, "; ".join(sorted(workloads))


def plot_throughputs(files: list[tuple[Path, dict]], out: Path) -> list[Path | None]:
    """One throughput plot per model: ``throughput_vs_prompt_len_<model>.png``."""
    groups = sorted(by_model(files).items())
    if not groups:
        return [plot_throughput([], out)]
    return [plot_throughput(group, out, f"throughput_vs_prompt_len_{label}.png") for label, group in groups]


def plot_throughput(files: list[tuple[Path, dict]], out: Path, png: str = THROUGHPUT_PNG) -> Path | None:
    series, ceiling, workload = throughput_points(files)
    if not any(len(points) > 1 for points in series.values()):
        print(
            f"[plot] skip {png}: no bench_throughput.py results with relay or default at two "
            f"system-prompt lengths"
        )
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, label in (("relay", "relay"), ("default", "vLLM default (prefix caching)")):
        points = sorted(series[name].items())
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, "o-", color=COLORS[name], label=label)
            for x, y in points:  # the higher of the two values at x labelled above, the lower below
                above = y >= max(other.get(x, y) for other in series.values())
                ax.annotate(
                    f"{y:.1f}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(8, 6 if above else -13),
                    fontsize=8,
                )
    if ceiling is not None:
        ax.axhline(
            ceiling, color=COLORS["noprefix"], linestyle="--", label=f"no system prompt ({ceiling:.1f})"
        )
    ax.set_xlabel("system-prompt length P (tokens)")
    ax.set_ylabel("throughput (requests/s)")
    ax.set_title(f"Throughput vs system-prompt length ({workload} tokens per request)", fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path = out / png
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def system_bars(files: list[tuple[Path, dict]]) -> dict[int, dict[str, dict[str, float]]]:
    """{P: {model: {config: requests/s}}} for P > 0 and the configs of SYSTEMS, each the median over
    the files giving it; a model with fewer than two systems at P is left out."""
    values: dict[int, dict[str, dict[str, list[float]]]] = {}
    for _path, data in files:
        P = int(data["args"]["prefix_len"])
        model = model_label(data["args"]["model"])
        for config, _ in SYSTEMS:
            if P > 0 and config in data and rps(data[config]) is not None:
                values.setdefault(P, {}).setdefault(model, {}).setdefault(config, []).append(rps(data[config]))
    bars = {
        P: {m: {c: statistics.median(v) for c, v in configs.items()} for m, configs in models.items()
            if len(configs) > 1}
        for P, models in values.items()
    }
    return {P: models for P, models in sorted(bars.items()) if models}


def plot_systems(files: list[tuple[Path, dict]], out: Path) -> list[Path | None]:
    """``requests_per_s_p<P>.png``: bars of each system's requests/s, grouped by model."""
    bars = system_bars(files)
    if not bars:
        print("[plot] skip requests_per_s_p<P>.png: no system-prompt length with two systems of one model")
        return [None]
    import matplotlib.pyplot as plt

    paths = []
    for P, models in bars.items():
        width = 0.8 / max(len(m) for m in models.values())
        fig, ax = plt.subplots(figsize=(2.2 + 2.4 * len(models), 4))
        labelled = set()
        for j, systems in enumerate(models.values()):  # a model's bars centred on its tick
            present = [(c, label) for c, label in SYSTEMS if c in systems]
            for i, (config, label) in enumerate(present):
                x, y = j + (i - (len(present) - 1) / 2) * width, systems[config]
                ax.bar(x, y, width, color=COLORS[config], label=None if config in labelled else label)
                ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
                labelled.add(config)
        ax.set_xticks(range(len(models)), list(models))
        ax.set_xlim(-0.6, len(models) - 0.4)
        ax.set_ylabel("throughput (requests/s)")
        ax.set_title(f"Requests behind one {P}-token system prompt", fontsize=10)
        ax.set_ylim(0, 1.25 * max(max(m.values()) for m in models.values()))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper right", ncols=2)
        fig.tight_layout()
        path = out / f"requests_per_s_p{P}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


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
    written = plot_throughputs(throughput, out) if "throughput" in args.figures else []
    if "systems" in args.figures:
        written += plot_systems(throughput, out)
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
