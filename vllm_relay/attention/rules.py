"""The planner's measured rules: when a step runs levels, how many a graph holds, how a level's call
is split, which prompt chunks read their levels, and the joint call's shape (ops/joint.py).

Each constant carries the measurement it comes from (benchmarks/results/). Host-side numpy only;
`planner.py` applies them.
"""

import numpy as np


# The measured rule: a step runs levels when they save at least MIN_SAVED_TOKENS of KV reads (tokens
# of one layer's K and V), the cost of their launches; else every request reads all its pages in
# one FlashAttention call, exactly vLLM's. Full CUDA graphs come in two kinds per decode size
# (hooks/graphs.py): vLLM's own, replayed by steps without levels, and one that also runs them.
# NOTE: from the H200 layer table (benchmarks/results/archive/2026-11-21_h200/layer_h200.md, one
# system prompt of S=2048):
# the shared path won from 16 (MHA) / 64 (GQA) requests when its launches were paid eagerly, i.e.
# from about 15 and 63 times 2048 tokens not read again; to be measured again for the level kinds
# of bench_layer.py (--only levels; the script is in git history).
# On the CPU the context call is vLLM's CPU attention kernel, and the levels run in torch (the
# kernel gives no LSE): there the levels never paid for themselves (bench_cpu_attention.py, in git
# history; benchmarks/results/archive/2026-11-25_cpu_attention/cpu_attention.md,
# tiny GQA model, 2 cores: attention 4.9x vLLM's CPU backend with levels against 1.02x on the prefix
# path at 64 requests over a 512-token prompt, 9.3x against 0.94x at 128 over 900), so "auto" plans
# none; "always" still runs them (the CPU exactness tests). Keyed by (device type, GQA > 1).
MIN_SAVED_TOKENS = {("cuda", False): 15 * 2048, ("cuda", True): 63 * 2048,
                    ("cpu", False): float("inf"), ("cpu", True): float("inf")}
# Levels per token at most (a fixed count for CUDA graphs: few-shot -> problem -> samples, under a
# system prompt); deeper sharing is read in the context.
MAX_LEVELS = 4
# Levels a full CUDA graph holds besides the system prompts' (a graph of T tokens could form 2T).
# FlashAttention-3 combines its key splits over every group of the graph's call, empty ones too.
# On the H100 (Llama-2-7B shape, one level of 384 rows over 2048 keys) the level's call takes 109 us
# in a graph of 770 groups, 62 us in one of 66, 54 us alone; a whole layer 480 -> 434 us; end to end
# (P=2048, 1000 requests) +2.9% (H100, 2026-11-26: benchmarks/results/archive/2026-11-26_ceiling/
# README.md, the 12:29 run).
# The tree keeps its shallowest levels; deeper ones are read in the context (exact either way).
GRAPH_LEVELS = 64
# A graph's levels run unsplit (`ops.force_one_split`) when their query tiles alone fill this share
# of the multiprocessors: FA3's schedule splits such levels in two, where one wave of whole tiles is
# faster and needs no combine (H100, a layer in a graph, us, one split against FA3's split at n=384:
# Llama-2-7B shape 422 / 433 at S=2048, 602 / 617 at S=16000; Llama-3-8B 180 / 192, 354 / 370; at
# 512 rows FA3 picks one itself); fewer rows over a long level still want the split (the unsplit
# kernel at S=16000, n=256: 470 / 392).
# benchmarks/results/archive/2026-11-26_ceiling/splits_one_split_h100.md.
ONE_SPLIT_FILL = 0.6
LEVEL_TILE_ROWS = 128  # FA3's query tile at head size 128; a split call packs a KV head's query heads
# A decode step's levels and context run as one call (ops/joint.py), each level in sequences of this
# many query rows (tokens x query heads per KV head). FA3 runs the whole call with a tile of 64 rows
# (one warpgroup) while its longest sequence has at most 64, else 128 (two). On the H100, a layer in a
# graph (bench_joint.py, in git history: benchmarks/results/archive/2026-11-26_ceiling/2026-11-28_0014/;
# us, one call with 64 / 128 rows against relay's two calls):
# Llama-2-7B shape, n=256, S=2048, c=128: 244 / 287 against 298; Llama-3-8B, n=128, S=8192, c=320:
# 110 / 134 against 135, n=256: 215 / 202 against 231, n=1024: 789 / 768 against 769. So 64 rows
# with one query head per KV head, and with more from 256 tokens on 128. Alone, a level of 64-row
# sequences runs at 370-390 TFLOP/s against 500-540 with 128 (H200, Llama-2-7B shape, S=8192,
# bench_page_size.py, in git history), yet with one query head per KV head the context's one-row sequences
# lose more on the 128-row tile: end to end (H200, 1000 requests, 128 rows in every step against
# the rule) P=2048 36.1 / 41.5 requests/s, P=8192 31.5 / 35.1 and 31.2 / 34.8 (H200, 2026-11-28:
# benchmarks/results/archive/2026-11-26_ceiling/2026-11-28_0613/).
JOINT_ROWS, JOINT_ROWS_LARGE, JOINT_LARGE_TOKENS = 64, 128, 256
# The joint call runs unsplit when the levels' tiles (sequences x KV heads) fill this share of the
# multiprocessors; with fewer, FA3 splits each sequence by its share of the call's work (its dynamic
# split): a few long level tiles would otherwise be the call's tail. Same bench (H100, us, dynamic /
# one split against relay's two calls): Llama-3-8B, n=16, S=8192: 41 / 92 against 49; n=64: 63 / 97
# against 70; Llama-2-7B, n=256, S=2048 (128 tiles): 290 / 253 against 294. At S=16000, n=256, c=128
# (H100, 2026-12-06, bench_ops.py --decode, benchmarks/results/2026-12-06_h100_vllm033_samples_sglang/):
# Llama-3-8B (128 rows: 64 tiles, 0.48 of the multiprocessors) 204 / 222, Llama-2-7B (64 rows: 128 tiles)
# 402 / 374. So the split from fewer tiles than 0.48 of them, unsplit from 0.97: the threshold between.
JOINT_SPLIT_FILL = 0.75
# An MLA step's MQA rows (tokens x query heads, all on the one latent KV head) run unsplit once FA3's
# query tiles of this many rows fill the multiprocessors: a split then buys no parallelism, and FA3
# allocates its split buffers ([splits, heads, tokens, 512] fp32) at each call, outside vLLM's memory
# profile (which runs the MHA form). Relay's requests carry only their own tokens, so their prompts ride
# the MQA form: a step of 16384 such tokens (DeepSeek-V2-Lite shape, H100, FA3's own choice of 4 splits)
# asked for 2 GiB more and ran out of memory; vLLM's own MQA rows are decodes of one token each.
MLA_TILE_ROWS = 64

def query_tiles(rows: np.ndarray, gqa: int) -> np.ndarray:
    """FA3's query tiles (a KV head's query heads packed) for each count of query rows."""
    return -(-np.asarray(rows, dtype=np.int64) * gqa // LEVEL_TILE_ROWS)


def joint_tokens(num_tokens: int, gqa: int, rows: int | None = None) -> int:
    """Tokens per level sequence of a joint call over `num_tokens` decode tokens (`JOINT_ROWS`;
    `rows`: the query rows of every step instead)."""
    if rows is None:
        rows = JOINT_ROWS_LARGE if gqa > 1 and num_tokens >= JOINT_LARGE_TOKENS else JOINT_ROWS
    return max(1, rows // gqa)


def graph_one_split(group_rows: np.ndarray, gqa: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a graph's levels of these rows run unsplit: their query tiles (a KV head's query
    heads packed, as FA3 does in a split call) fill ONE_SPLIT_FILL of the multiprocessors."""
    return int(query_tiles(group_rows, gqa).sum()) * num_kv_heads >= ONE_SPLIT_FILL * num_sms


def joint_one_split(group_rows: np.ndarray, tokens_per_seq: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a joint call over levels of these rows runs unsplit: their sequences of at most
    `tokens_per_seq` rows (`ops.joint_layout`) times the KV heads fill JOINT_SPLIT_FILL of the
    multiprocessors.

    Example:
        >>> joint_one_split(np.array([256]), 64, 32, 132), joint_one_split(np.array([64, 1]), 64, 32, 132)
        (True, False)
    """
    seqs = int((-(-np.asarray(group_rows, dtype=np.int64) // tokens_per_seq)).sum())
    return seqs * num_kv_heads >= JOINT_SPLIT_FILL * num_sms


def mla_one_split(num_tokens: int, num_heads: int, num_sms: int) -> bool:
    """Whether an MLA step's MQA call over `num_tokens` rows of `num_heads` query heads runs unsplit.

    Example:
        >>> mla_one_split(256, 16, 132), mla_one_split(16384, 16, 132)
        (False, True)
    """
    return -(-num_tokens * num_heads // MLA_TILE_ROWS) >= num_sms


def fills_tiles(q_lens: np.ndarray, gqa: int) -> np.ndarray:
    """Prompt chunks that fill their own query tiles (the tiles at least four fifths full).
    FlashAttention reads the keys once per query tile, so a level saves such a chunk no reads: it
    would only add the gather of its rows, a second call and the fusion. Read in its context (the
    prefix path), a chunk's shared and own keys are one call (Llama-2-7B shape, P=2048: a step of
    128 such chunks took 33 ms more attention than without the prompt, against 24 ms of FLOPs,
    benchmarks/results/archive/2026-11-26_ceiling/acct_llama2_r_s11.md).

    Example:
        >>> fills_tiles(np.array([1, 100, 128, 129, 256, 300]), 1).tolist()
        [False, False, True, False, True, False]
    """
    rows = np.asarray(q_lens, dtype=np.int64) * gqa
    return (rows > 0) & (4 * query_tiles(q_lens, gqa) * LEVEL_TILE_ROWS <= 5 * rows)
