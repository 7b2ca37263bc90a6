"""benchmarks/plot.py: PNGs from the results folder; missing data skips a plot with a message."""

import json
import shutil

import pytest

from tests.benchmarks import BENCH, load

pytest.importorskip("matplotlib")

plot = load("plot")

PNG = b"\x89PNG\r\n\x1a\n"


def serving(rates=(1.0, 4.0, 8.0)):
    def row(rate, scale):
        def lat(ms):
            return {"p50": ms * scale * rate, "p99": 2.5 * ms * scale * rate}

        return {
            "rate": rate,
            "ttft_ms": lat(10.0),
            "tpot_ms": lat(2.0),
            "e2e_ms": lat(500.0),
            "req_per_s": min(rate, 6.0 / scale),
        }

    return {
        "model": "/x/llama-2-7b-shape-9c37a19155",
        "configs": {"relay": [row(r, 1.0) for r in rates], "default": [row(r, 3.0) for r in rates]},
    }


def throughput_file(model, P, nested, **rps):
    entry = (lambda v: {"single": {"requests_per_s": v}, "multi": {"requests_per_s": v / 2}}) if nested else \
        (lambda v: {"requests_per_s": v})
    return {"args": {"prefix_len": P, "model": f"/x/{model}-9c37a19155", "input_len": 128, "output_len": 256},
            **{config.replace("_", "-"): entry(v) for config, v in rps.items()}}


def test_serving_json_gives_a_latency_plot(tmp_path, capsys):
    (tmp_path / "serving_h200.json").write_text(json.dumps(serving()))
    assert plot.main(["--results", str(tmp_path)]) == 0
    assert (tmp_path / "serving_h200.png").read_bytes().startswith(PNG)
    out = capsys.readouterr().out
    assert f"skip {plot.THROUGHPUT_PNG}: no bench_throughput.py results" in out
    assert not (tmp_path / plot.THROUGHPUT_PNG).exists()


def test_missing_files_skip_with_a_message(tmp_path, capsys):
    shutil.copy(BENCH / "results" / "archive" / "2026-11-21_h200" / "e2e_acc_llama2.json", tmp_path)  # accuracy: not plotted
    assert plot.main(["--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skip the latency plots: no serving benchmark JSON" in out and "wrote" not in out
    assert list(tmp_path.glob("*.png")) == []


def test_a_broken_serving_file_names_what_it_lacks(tmp_path):
    data = serving()
    del data["configs"]["relay"][1]["tpot_ms"]["p99"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"bad.json: configs\['relay'\] row 4.0 lacks \['tpot_ms.p99'\]"):
        plot.main(["--results", str(tmp_path)])


def test_throughput_bars_are_medians_per_model_and_prompt_length(tmp_path, capsys):
    files = {
        "a.json": throughput_file("llama-3-8b-shape", 2048, True, relay=70.0, default=42.0, noprefix=71.0),
        "b.json": throughput_file("llama-3-8b-shape", 2048, True, relay=72.0, default=40.0, sglang=33.0),
        "c.json": throughput_file("llama-3-8b-shape", 2048, True, relay=69.0, default=44.0, sglang=31.0),
        "d.json": throughput_file("llama-2-7b-shape", 8192, False, relay=35.0, noprefix=43.0),  # the older flat form
        "e.json": throughput_file("llama-2-7b-shape", 2048, True, relay=42.0),  # one system: no group
        "f.json": throughput_file("llama-2-7b-shape", 0, True, noprefix_relay=43.5),  # not a system: ignored
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    bars = plot.throughput_bars(plot.load(tmp_path)[0])
    assert bars == {("llama-2-7b-shape", 8192): {"relay": 35.0, "noprefix": 43.0},
                    ("llama-3-8b-shape", 2048): {"relay": 70.0, "default": 42.0, "noprefix": 71.0, "sglang": 32.0}}
    assert list(bars) == sorted(bars)
    assert plot.main(["--results", str(tmp_path), "--figures", "throughput"]) == 0
    png = tmp_path / plot.THROUGHPUT_PNG
    assert png.read_bytes().startswith(PNG) and png.stat().st_size > 10_000
    assert "latency plots" not in capsys.readouterr().out  # serving not asked for


def test_the_readmes_picture_is_drawn_from_its_files(tmp_path):
    """The command in the picture's folder README, run again, gives the bars its table states."""
    folder = BENCH / "results" / "2026-12-05_h200_vllm033_headline"
    readme = (folder / "README.md").read_text()
    paths = []
    for line in readme.split("```bash")[1].split("```")[0].split():
        if line.startswith("$R/") and line.endswith(".json"):
            head, _, tail = line[3:].partition("{")
            names = [head + alt + tail.split("}")[1] for alt in tail.split("}")[0].split(",")] if tail else [head]
            paths += [BENCH / "results" / n for n in names]
    assert len(paths) == 6 and all(p.exists() for p in paths)
    bars = {model: systems for (model, _), systems in plot.throughput_bars(plot.load(paths)[0]).items()}
    rows = {line.split("|")[1].strip().split("`")[1]: line.split("|")[2:6] for line in readme.splitlines()
            if line.startswith("| `llama")}
    for model, cells in rows.items():
        for (config, _), cell in zip(plot.SYSTEMS, cells):
            stated = cell.strip().strip("*")
            assert (f"{bars[model][config]:.2f}" if config in bars[model] else "") == stated, (model, config)
    assert {P for _, P in plot.throughput_bars(plot.load(paths)[0])} == {2048}
    assert plot.main(["--results", *map(str, paths), "--figures", "throughput", "--out", str(tmp_path)]) == 0
    assert (tmp_path / plot.THROUGHPUT_PNG).read_bytes().startswith(PNG)
