"""benchmarks/bench_mla.py on the CPU: relay's split of an MLA decode step (a latent level read by every
request's query rows, each request's own tokens, merged by LSE) against whole-sequence attention in fp32,
on the step `case` builds; the bytes and FLOPs of each way against hand-computed values."""

import pytest
import torch

from tests.benchmarks import load

bench = load("bench_mla")


@pytest.mark.parametrize("heads,n,blocks,c,seed", [(16, 5, 3, 100, 0), (3, 1, 1, 1, 1), (7, 9, 2, 130, 2)])
def test_split_equals_whole_sequence_attention(heads, n, blocks, c, seed):
    P = blocks * bench.BLOCK
    q, latent, prompt, own_tables, own, tables = bench.case(heads, n, P, c, device="cpu", seed=seed)
    assert tables.shape == (n, blocks + -(-c // bench.BLOCK)) and (tables[:, :blocks] == prompt).all()
    assert all(1 <= o <= c for o in own)
    whole = bench.reference(q, latent, tables, torch.tensor([P + o for o in own]))
    split = bench.split_reference(q, latent, prompt, own_tables, P, own)
    assert whole.shape == split.shape == (n, heads, bench.LATENT)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


def test_split_differs_when_a_request_reads_another_prompt():
    q, latent, prompt, own_tables, own, tables = bench.case(4, 3, 2 * bench.BLOCK, 70, device="cpu", seed=3)
    whole = bench.reference(q, latent, tables, torch.tensor([2 * bench.BLOCK + o for o in own]))
    split = bench.split_reference(q, latent, own_tables[0, :2], own_tables, 2 * bench.BLOCK, own)
    assert (split - whole).abs().max() > 1e-2


def test_step_cost_counts_each_ways_bytes_and_the_flops():
    cost = bench.step_cost(heads=2, P=64, own=[1, 3])
    assert cost["flops"] == 2 * 2 * (2 * 64 + 4) * (576 + 512) == 574_464
    q, o, lse = 2 * 2 * 576 * 2, 2 * 2 * 512 * 2, 2 * 2 * 4
    assert cost["flashmla_bytes"] == 132 * 1152 + q + o == 160_768
    assert cost["relay_bytes"] == 68 * 1152 + 2 * q + 2 * (2 * o + 2 * lse) + o == 108_096


def test_bound_is_memory_or_compute_whichever_is_slower():
    card = {"copy_bytes_per_s": 1e12, "bf16_flop_per_s": 1e15}
    assert bench.bound_ms(1e9, 2e12, card) == pytest.approx(2.0)
    assert bench.bound_ms(3e9, 2e12, card) == pytest.approx(3.0)


def test_the_table_leaves_fa3s_columns_empty_where_its_form_was_left_out(tmp_path):
    card = dict(device="H", copy_bytes_per_s=3e12, bf16_flop_per_s=7.5e14)
    base = dict(shape="s", heads=16, P=4096, n=64, c=256, flashmla_us=100.0, flashmla_bound_us=90.0, relay_us=50.0,
                relay_bound_us=40.0, flashmla_over_relay=2.0, relay_tflops=300.0, flashmla_gbs=2500.0,
                max_abs_diff=0.01)
    rows = [dict(base, fa3_us=110.0, relay_fa3_us=45.0, fa3_over_relay_fa3=2.44, fa3_graph_us=120.0,
                 relay_fa3_graph_us=60.0, relay_fa3_ctx1_us=50.0, fa3_graph_over_relay_fa3_graph=2.0), base]
    bench.write(str(tmp_path), card, rows)
    lines = (tmp_path / "mla_ops.md").read_text().splitlines()
    header, with_fa3, without = lines[4], lines[6], lines[7]
    assert header.count("|") == with_fa3.count("|") == without.count("|") == lines[5].count("|") == 20
    assert "| 110.0 | 45.0 | 2.44x | 120.0 | 60.0 | 50.0 | 2.00x | 0.01 |" in with_fa3
    assert without.endswith("| 2500 |  | |  | | | |  | 0.01 |")
