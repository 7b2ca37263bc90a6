"""The planner's choices for relay's MLA backend (attention/mla_backend.py), without a GPU: values narrower
than keys (MLA's latent cache: keys the whole vector, values its first part), requests past a query length
kept off the levels (vLLM runs them in MLA's MHA form), and the context tables' host bound on their lengths
(MLA's prefill reads it). Plans run by `relay_attention` over the torch varlen function, against dense
attention over [system K/V ; own K/V] in fp32, on random mixed batches (test_planner.py's world)."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.attention.test_planner import BLOCK, D, World, as_relay_plan, random_batch, run_and_check, vllm_config
from tests.ops.reference import attention_ref
from vllm_relay.attention import levels as levels_module
from vllm_relay.attention.planner import RelayPlanner
from vllm_relay.ops import relay_attention, varlen_attention_torch

DV = 40  # the values' size: the keys' first DV values (MLA: 512 of 576)


def make_planner(shared_path="auto", **kwargs):
    return RelayPlanner(vllm_config(shared_path), SimpleNamespace(block_size=BLOCK), "cpu", **kwargs)


def latent(world):
    """The world's values made its keys' first DV values, in the cache and in the reference's K/V."""
    world.v_cache = world.k_cache[..., :DV]
    world.own = [(k, k[..., :DV]) for k, _ in world.own]
    world.sys = [(k, k[..., :DV]) for k, _ in world.sys]
    return world


def latent_reference(world):
    out, row = torch.zeros(world.q.shape[0], world.q.shape[1], DV), 0
    for (slot, _, ql, _, _), (k, v) in zip(world.batch, world.own):
        if slot >= 0:
            k, v = torch.cat([world.sys[slot][0], k]), torch.cat([world.sys[slot][1], v])
        out[row: row + ql], _ = attention_ref(world.q[row: row + ql], k, v, D ** -0.5, causal=True)
        row += ql
    return out


@pytest.mark.parametrize("shared_path", ["auto", "always"])
@pytest.mark.parametrize("seed", range(4))
def test_latent_levels_are_exact(shared_path, seed, monkeypatch):
    monkeypatch.setitem(levels_module.MIN_SAVED_TOKENS, ("cpu", True), 64)  # small batches do share
    rng = np.random.default_rng(seed)
    world = latent(World(random_batch(rng, int(rng.integers(2, 14))), torch.float32, "cpu", seed))
    world.record_fills()
    planner = make_planner(shared_path=shared_path, joint=False, value_size=DV)
    assert planner.out_buf.shape[-1] == DV and planner.q_buf.shape[-1] == D
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    out = torch.full((world.q.shape[0], world.q.shape[1], DV), float("nan"))
    relay_attention(world.q, world.k_cache, world.v_cache, as_relay_plan(plan, cm), out, D ** -0.5,
                    varlen_attention_torch)
    torch.testing.assert_close(out, latent_reference(world), atol=2e-5, rtol=2e-5)
    if shared_path == "always" and any(s >= 0 and q == 1 for s, _, q, _, _ in world.batch):
        assert planner.stats["shared_tokens"] > 0  # the levels ran


def test_values_narrower_than_keys_take_two_calls():
    with pytest.raises(ValueError, match="MLA"):
        make_planner(value_size=DV)  # the joint call (the default) holds keys and values alike


@pytest.mark.parametrize("seed", range(4))
def test_requests_past_the_query_bound_read_no_level(seed):
    """With `max_level_query_len` 3, a request of more tokens this step reads its whole context (a
    registered prompt's pages in front: the prefix path), the others their levels; exact either way."""
    rng = np.random.default_rng(seed)
    batch = random_batch(rng, int(rng.integers(4, 14)))
    batch[0] = (0, 120, 6, -1, 0)  # a registered prompt's request of 6 tokens: past the bound
    world = World(batch, torch.float32, "cpu", seed)
    world.record_fills()
    planner = make_planner(shared_path="always", max_level_query_len=3)
    cm = world.cm()
    plan = planner.plan(cm, world.step())
    run_and_check(world, plan, cm)
    q_lens = np.array([row[2] for row in batch])
    token_q_len = np.repeat(q_lens, q_lens)
    rows = plan.level.row_index.reshape(-1, cm.num_actual_tokens).numpy()
    assert (rows[:, token_q_len > 3] == -1).all()
    assert (rows[:, token_q_len <= 3] >= 0).any()  # the others do read levels (shared_path "always")


@pytest.mark.parametrize("seed", range(4))
def test_the_context_bound_is_the_context_tables_lengths(seed):
    """vLLM's host bound on each request's length, moved as the context tables move it (a registered
    prompt's pages in front, the pages a level reads for it left out): equal to the tables' lengths."""
    rng = np.random.default_rng(seed)
    world = World(random_batch(rng, int(rng.integers(2, 14))), torch.float32, "cpu", seed)
    world.record_fills()
    planner = make_planner(shared_path="always")
    cm = world.cm()
    cm = dataclasses.replace(cm, seq_lens_cpu_upper_bound=cm.seq_lens.cpu().clone())
    plan = planner.plan(cm, world.step())
    B = cm.num_reqs
    assert torch.equal(plan.context.seq_lens_cpu_upper_bound[:B], plan.context.seq_lens[:B].cpu())
    assert not torch.equal(plan.context.seq_lens_cpu_upper_bound, cm.seq_lens_cpu_upper_bound) or not any(
        s >= 0 for s, *_ in world.batch)  # (moved wherever a registered prompt is in front)
    assert planner.plan(world.cm(), world.step()).context.seq_lens_cpu_upper_bound is None  # none given: none
