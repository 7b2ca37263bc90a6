"""benchmarks/plot.py: PNGs from the results folder; missing data skips a plot with a message."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
spec = importlib.util.spec_from_file_location("plot", BENCH / "plot.py")
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)

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


def test_repository_results_give_the_throughput_plot(tmp_path, capsys):
    assert plot.main(["--out", str(tmp_path)]) == 0
    png = tmp_path / plot.THROUGHPUT_PNG
    assert png.read_bytes().startswith(PNG) and png.stat().st_size > 10_000
    series, ceiling, workload = plot.throughput_points(plot.load(BENCH / "results")[0])
    # From e2e_tp_2048/8192.json, e2e_noprefix.json and e2e_ref_2048.json.
    assert series["relay"] == {
        0: pytest.approx(43.36, abs=0.01),
        2048: pytest.approx(38.42, abs=0.01),
        8192: pytest.approx(35.27, abs=0.01),
    }
    assert series["default"][2048] == pytest.approx(14.68, abs=0.01) and series["default"][0] == ceiling
    assert ceiling == pytest.approx((44.31 + 44.73) / 2, abs=0.01)
    assert workload == "llama-2-7b-shape, 128 in / 256 out"


def test_serving_json_gives_a_latency_plot(tmp_path, capsys):
    (tmp_path / "serving_h200.json").write_text(json.dumps(serving()))
    assert plot.main(["--results", str(tmp_path)]) == 0
    assert (tmp_path / "serving_h200.png").read_bytes().startswith(PNG)
    out = capsys.readouterr().out
    assert f"skip {plot.THROUGHPUT_PNG}: no bench_throughput.py results" in out
    assert not (tmp_path / plot.THROUGHPUT_PNG).exists()


def test_missing_files_skip_with_a_message(tmp_path, capsys):
    shutil.copy(BENCH / "results" / "e2e_acc_llama2.json", tmp_path)  # accuracy: not plotted
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
