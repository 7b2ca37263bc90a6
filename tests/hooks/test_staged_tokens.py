"""hooks/staged_tokens.py: a step's staged token ids kept as chunks, an equal list converted once, give
numpy exactly the values a plain list of them gives (fresh random writes of odd lengths, equal lists
with their own int objects, lists alike at both ends but not between, single values, floats); on CUDA,
Model Runner V2's own `StagedWriteTensor` writes the same GPU tensor with them as without."""

import pickle
import random

import numpy as np
import pytest

from vllm_relay.hooks import staged_tokens
from vllm_relay.hooks.staged_tokens import MIN_SHARED, StagedChunks


def fresh(values: list) -> list:
    """An equal list with int objects of its own (as each request's ids arrive decoded apart)."""
    return pickle.loads(pickle.dumps(values))


def writes(rng: random.Random) -> list:
    """A step's writes in order: ("extend", list) or ("append", value)."""
    prompt = [rng.randrange(100, 32000) for _ in range(MIN_SHARED * 3 + 7)]
    alike = prompt[:]  # the same length, first and last value; one value in between differs
    alike[len(alike) // 2] += 1
    out = []
    for _ in range(rng.randrange(20, 40)):
        kind = rng.randrange(6)
        if kind == 0:
            out.append(("extend", fresh(prompt)))
        elif kind == 1:
            out.append(("extend", fresh(alike)))
        elif kind == 2:
            out.append(("extend", [rng.randrange(32000) for _ in range(rng.randrange(1, MIN_SHARED * 2))]))
        elif kind == 3:
            out.append(("append", rng.randrange(32000)))
        elif kind == 4:
            out.append(("extend", fresh(prompt[: rng.randrange(1, len(prompt))])))
        else:
            out.append(("extend", []))
    return out


def staged(ops: list, contents):
    for op, x in ops:
        getattr(contents, op)(x)
    return contents


@pytest.mark.parametrize("seed", range(6))
def test_chunks_give_numpy_the_values_a_list_gives(seed):
    rng = random.Random(seed)
    ops = writes(rng)
    want, got = staged(ops, []), staged(ops, StagedChunks())
    assert len(got) == len(want) and list(got) == want
    for dtype in (np.int32, np.int64, np.float32):
        a, b = np.full(len(want) + 3, -1, dtype=dtype), np.full(len(want) + 3, -1, dtype=dtype)
        a[: len(want)] = want
        b[: len(got)] = got
        assert (a == b).all()
    long_lists = [tuple(x) for op, x in ops if op == "extend" and len(x) >= MIN_SHARED]
    assert got.shared == sum(len(x) for i, x in enumerate(long_lists) if x in long_lists[:i])
    got.clear()
    assert len(got) == 0 and got.shared == 0 and np.asarray(got).shape == (0,)
    staged(ops[:3], got)  # reused after a clear, as the runner does every step
    assert (np.asarray(got) == np.asarray(staged(ops[:3], []))).all()


def test_equal_lists_are_converted_once_and_staged_values_do_not_move(monkeypatch):
    calls = []
    real = np.array

    def counting(x, *args, **kwargs):
        calls.append(len(x))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(staged_tokens.np, "array", counting)
    prompt = [random.Random(1).randrange(32000) for _ in range(MIN_SHARED + 1)]
    chunks, lists = StagedChunks(), [fresh(prompt) for _ in range(5)]
    for x in lists:
        chunks.extend(x)
    lists[0].append(7)  # the request's list grows after it was staged: what was staged stays
    lists[1][0] += 1
    assert chunks.shared == 4 * len(prompt)
    out = real(chunks.__array__())
    assert calls == [len(prompt)] and (out == prompt * 5).all()
    floats = StagedChunks()
    floats.extend([0.5] * MIN_SHARED)
    floats.append(2)
    assert real(floats.__array__()).tolist() == [0.5] * MIN_SHARED + [2.0]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_steps_of_every_size_convert_into_kept_memory_as_a_list_converts(dtype):
    rng = random.Random(11)
    chunks = StagedChunks(dtype)
    for step in range(8):  # growing and shrinking steps, as the runner clears and reuses it
        ops = writes(rng)[: rng.randrange(1, 40)]
        want = staged(ops, [])
        staged(ops, chunks)
        a, b = np.full(len(want) + 2, -1, dtype=dtype), np.full(len(want) + 2, -1, dtype=dtype)
        a[: len(want)] = want
        b[: len(chunks)] = chunks
        assert (a == b).all(), step
        assert len(chunks._values) == len(want) - chunks.shared  # each repeated list converted once
        mine = np.array(chunks, copy=True)  # a copy asked for is the caller's own
        chunks.clear()
        chunks.extend([7] * MIN_SHARED)
        np.asarray(chunks)
        assert (mine == a[: len(want)]).all()
        chunks.clear()


class _Tensor:  # what `install` reads of a StagedWriteTensor
    def __init__(self, uva: bool):
        import torch

        self.write_contents = object() if uva else None
        self._staged_write_contents = []
        self.dtype = torch.int32


def test_install_only_where_numpy_converts_the_values():
    from types import SimpleNamespace

    uva, dense = SimpleNamespace(all_token_ids=_Tensor(True)), SimpleNamespace(all_token_ids=_Tensor(False))
    assert staged_tokens.install(uva) and isinstance(uva.all_token_ids._staged_write_contents, StagedChunks)
    assert uva.all_token_ids._staged_write_contents.dtype == np.int32
    assert not staged_tokens.install(dense) and dense.all_token_ids._staged_write_contents == []


@pytest.mark.gpu
def test_model_runner_v2_staging_writes_the_same_tensor_with_chunks():
    import torch
    from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor

    rng = random.Random(7)
    tensors = {}
    for name in ("list", "chunks"):
        t = StagedWriteTensor((40, 4096), dtype=torch.int32, device=torch.device("cuda"), uva_instead_of_gpu=True)
        if name == "chunks":
            assert staged_tokens.install(type("States", (), {"all_token_ids": t})())
        tensors[name] = t
    for _ in range(3):  # steps: each stages a prompt's samples and other requests, then applies them
        prompt = [rng.randrange(32000) for _ in range(rng.randrange(MIN_SHARED, 4000))]
        ops = [(row, rng.randrange(0, 96), prompt if rng.random() < 0.6 else
                [rng.randrange(32000) for _ in range(rng.randrange(1, 900))]) for row in rng.sample(range(40), 12)]
        for t in tensors.values():
            for row, start, ids in ops:
                t.stage_write(row, start, fresh(ids))
            t.stage_write_elem(ops[0][0], 5)
            t.apply_write()
    torch.cuda.synchronize()
    assert torch.equal(tensors["list"].gpu, tensors["chunks"].gpu) and tensors["list"].gpu.any()
