"""The launch rules of the window level's kernel (`window_level.py`): its tiles, its key ranges, and the
multiprocessors they are held to. Each rule with the measurement it comes from; host-side only."""

import functools

import torch
import triton

MAX_SPLITS = 16  # key ranges a program's keys are cut into, at most
MIN_SPLIT_KEYS = 128  # keys a range holds, at least (rounded to the key tile)
SMALL_TILE_WAVES = 4  # programs a multiprocessor, at most, for the small tiles of large heads
# A call of at least this many groups launches a grid of COMPACT_WAVES programs a multiprocessor looping
# over the step's real tiles, instead of a program for every tile of every group (None: never). A CUDA
# graph's call has a group per level it can hold, most of them empty. H100, one level of B rows over a
# 2048-token prompt, us: alone by group / among a decode graph's groups (18 at B=8, 66 at 64 and 256) by
# group / the same compact: Gemma 3's window layers B=8 25.9 / 77.8 / 26.1, B=64 44.4 / 146.0 / 41.5,
# B=256 85.9 / 141.1 / 78.4; gpt-oss's 12.1 / 12.0 / 12.5, 11.7 / 13.7 / 12.7, 12.9 / 22.9 / 14.5. So every
# call is compact (1): a graph's and an eager step's calls are then one compiled variant (BLOCK_G, at
# least 128, too), where an eager variant otherwise compiles in the first step that reads a level.
COMPACT_FROM_GROUPS: int | None = 1
MAX_COMPACT_GROUPS = 1024  # (each program reads every group's row count)
COMPACT_WAVES = 2


def tiles(max_rows: int, group: int, head_dim: int, parallel: int = 1, num_sms: int | None = None):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps): tiles of ROWS = BLOCK_M // group rows x group heads, BLOCK_M a
    power of two >= 16 (tl.dot's smallest M) holding at least one row; up to 64 (ROWS * group) pairs when
    the groups have rows enough to fill them. A decode level (one row a request, often a few requests)
    fills a tile with GQA heads alone at group >= 16. The K and V tiles' addresses ([BLOCK_D, BLOCK_N] of
    them, a table lookup per key) are most of a program's registers: keys a tile and warps are those with
    which ptxas keeps every tile in registers on Hopper, no spills (checked for the served head sizes by
    tests/ops/test_window_level.py, compiling for sm_90a). Heads larger than 128 take the smallest BLOCK_M
    where the grid stays within SMALL_TILE_WAVES programs a multiprocessor (`parallel`: the programs of each
    tile index, groups x KV heads; a CUDA graph's groups are its capacity, most of them empty, each empty
    program launched all the same): their wider tiles of keys pay more than rows shared by a tile (one
    group of Gemma 3's window layers, 64 and 256 rows over a 2048-token level, H100: 72.6 and 84.8 us in
    tiles of 16 x 32 keys, 142.1 and 141.5 in 64 x 16)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    least = max(16, triton.next_power_of_2(group))
    block_m = max(least, min(64, triton.next_power_of_2(max(1, max_rows * group))))
    if block_d > 128 and (num_sms is None
                          or parallel * triton.cdiv(max_rows, least // group) <= SMALL_TILE_WAVES * num_sms):
        block_m = least
    block_n = 64 if block_d <= 128 else 32 if block_m <= 16 else 16
    num_warps = 4 if block_d <= 64 else 8
    return block_m, block_n, block_d, num_warps


def num_splits(programs: int, num_sms: int, keys: int | None = None) -> int:
    """Key ranges each program's keys are cut into: 1 where the grid's `programs` (groups x KV heads x
    tiles, empty groups too: a CUDA graph's groups are its capacity, and each range multiplies them all)
    fill the multiprocessors; else enough for about twice their count. A range holds MIN_SPLIT_KEYS keys
    at least, and no more ranges than `keys` (the most keys a row reads: a window's length) fill: a range
    past them is a program that reads nothing and a partial merged all the same (gpt-oss's 128-token
    windows, 8 and 64 rows over a 2048-token level, H100: 12.4 and 12.5 us whole, 20.1 and 23.2 in 16
    and 8 ranges)."""
    if programs >= num_sms:
        return 1
    fill = MAX_SPLITS if keys is None else max(1, min(MAX_SPLITS, keys // MIN_SPLIT_KEYS))
    return min(1 << (fill.bit_length() - 1), triton.next_power_of_2(triton.cdiv(2 * num_sms, programs)))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def launch(num_rows: int, group: int, num_kv_heads: int, head_dim: int, num_groups: int, max_rows: int,
           keys: int | None, num_sms: int) -> tuple[tuple[int, ...], dict]:
    """A call's grid and the kernel's launch constants (tiles, warps, ranges, grid kind), from the rules
    above: `num_rows` rows (N), `num_groups` groups of at most `max_rows` rows, each row reading at most
    `keys` keys. The constants are what a compiled variant is made of, so they depend on the call's
    shape alone: a CUDA graph's call (its capacity of groups) and an eager step's (its real ones) of as
    many rows share one."""
    packed = compact(num_groups)
    parallel = num_kv_heads if packed else num_groups * num_kv_heads  # programs a tile index makes
    block_m, block_n, block_d, num_warps = tiles(max_rows, group, head_dim, parallel, num_sms)
    rows = block_m // group  # a tile's
    n_tiles = triton.cdiv(max_rows, rows)
    splits = num_splits(parallel * n_tiles, num_sms, keys)
    grid = (num_groups, num_kv_heads, n_tiles * splits)
    if packed:  # as many programs as the step's tiles can fill, at most (its rows: at most N)
        most = (triton.cdiv(num_rows, rows) + min(num_groups, num_rows)) * num_kv_heads * splits
        grid = (min(most, COMPACT_WAVES * num_sms),)
    return grid, dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, SPLITS=splits,
                      MIN_CHUNK=max(block_n, MIN_SPLIT_KEYS // block_n * block_n), COMPACT=packed,
                      BLOCK_G=max(128, triton.next_power_of_2(num_groups)) if packed else 1)


def one_group_variants(group: int, num_kv_heads: int, head_dim: int, max_rows: int, keys: int | None,
                       num_sms: int) -> dict[tuple, int]:
    """The launch constants of a call of one group and 1 to `max_rows` rows (an eager step's prompt chunk
    reading a level), each with the fewest rows that take it. The tiles only widen and the key ranges only
    fall as the rows grow, so past the first row count whose constants are the largest count's, every
    count has them."""
    def constants(rows):
        return tuple(sorted(launch(1, group, num_kv_heads, head_dim, 1, rows, keys, num_sms)[1].items()))

    variants, last = {}, constants(max_rows)
    for rows in range(1, max_rows + 1):
        c = constants(rows)
        variants.setdefault(c, rows)
        if c == last:
            break
    return variants


def compact(num_groups: int) -> bool:
    """Whether a call of `num_groups` groups loops over its step's real tiles (COMPACT_FROM_GROUPS)."""
    return COMPACT_FROM_GROUPS is not None and COMPACT_FROM_GROUPS <= num_groups <= MAX_COMPACT_GROUPS
