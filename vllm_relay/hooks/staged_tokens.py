"""Model Runner V2's staging of new requests' token ids, with each equal list converted once.

When a step admits new requests, Model Runner V2 stages each one's token ids for its GPU copy of every
request's tokens (`RequestState.all_token_ids`, a `StagedWriteTensor`): it extends one Python list with
every request's ids, and numpy converts that list to int32 element by element when the step's writes
are applied (`StagedWriteTensor.apply_write`). The n samples of one prompt arrive as n requests with
equal token lists, so admitting 255 samples of a 16000-token prompt converts 4 million Python ints, in
the step that gives them their first token. In a relay engine that list is a `StagedChunks`: a list
equal to one staged before in the step is kept as a reference to it, numpy converts the rest as it
converts vLLM's list, and the references are copies of that conversion: the same values reach the same
places of the GPU tensor.

Comparing two equal lists of 16000 ints costs about as much as converting one, unless their elements are
the same objects (Python compares those by identity first). The n samples' lists are made of the same
ints: vLLM's front end gives its n children one prompt list, relay's transport sends it to the engine
core once (`hooks/transport.py`), and each request's token list is a copy of its prompt list; so a
sample's list compares equal to its first sibling's at a pointer compare a token. The first one's
values are sliced out of the staged values once, when a second list of its length and ends comes, and
every later one compares with that slice.
"""

from __future__ import annotations

import numpy as np

from vllm_relay.hooks._patch import swap

MIN_SHARED = 512  # lists shorter than this are converted as they come (little to save)


class StagedChunks:
    """What `StagedWriteTensor` keeps in `_staged_write_contents`, the values of a step's staged writes
    in order: it calls `extend` with each write's values, `append` with single ones, `len`, `clear`,
    and hands the whole to numpy (`dst[:n] = contents`, through `__array__`; any other reader iterates
    it). The values go into one list, as into vLLM's, except a list of `MIN_SHARED` values or more
    equal to one staged before in the step: that is kept as a reference to the earlier one's place,
    and numpy's conversion of the list is copied there. `dtype`: the numpy type to convert to (None:
    numpy's choice, converted afresh each step); with one, the conversion goes into memory kept
    from step to step (vLLM converts its list straight into its staging buffer: a fresh array each
    step would cost traffic sharing nothing its page faults), and numpy is handed a view of it."""

    def __init__(self, dtype=None) -> None:
        self.dtype = dtype
        self._values: list = []  # every value but those of a repeated list, in order
        self._pieces: list[list[int]] = []  # the contents in order: [start, length] in `_values`
        # (length, first, last) -> [start in `_values`, a private copy of the list (made when a second
        # list of that key comes) or None] of each such list staged
        self._by_key: dict[tuple, list[list]] = {}
        self._len = 0
        self.shared = 0  # values staged as a reference to an equal list of the step (until cleared)

    def __len__(self) -> int:
        return self._len

    def append(self, value) -> None:
        self._add(len(self._values), 1)
        self._values.append(value)

    def extend(self, values) -> None:
        values = values if isinstance(values, list) else list(values)
        n = len(values)
        if n >= MIN_SHARED:
            staged = self._by_key.setdefault((n, values[0], values[-1]), [])
            for entry in staged:
                start, copy = entry
                if copy is None:  # one slice a distinct list, not one each list compared with it
                    copy = entry[1] = self._values[start: start + n]
                if copy == values:
                    self._add(start, n)
                    self.shared += n
                    return
            staged.append([len(self._values), None])
        self._add(len(self._values), n)
        self._values.extend(values)

    def clear(self) -> None:
        self._values.clear()
        self._pieces.clear()
        self._by_key.clear()
        self._len = 0
        self.shared = 0

    def __iter__(self):  # for a reader that iterates the list (vLLM's fused writer does, of other tensors')
        for start, n in self._pieces:
            yield from self._values[start: start + n]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self.dtype is None:  # numpy's choice of type: converted afresh
            values = np.array(self._values)
        else:  # into memory kept from step to step, as vLLM's list is converted into its staging buffer
            values = self._scratch("_converted", len(self._values))
            values[:] = self._values
        if self.shared:
            out = np.empty(self._len, values.dtype) if self.dtype is None else self._scratch("_expanded", self._len)
            np.concatenate([values[start: start + n] for start, n in self._pieces], out=out)
            values = out
        if dtype is not None and np.dtype(dtype) != values.dtype:
            return values.astype(dtype)
        return values.copy() if copy else values  # (a view of the scratch memory: numpy copies it out)

    def _scratch(self, name: str, n: int) -> np.ndarray:
        """The first `n` elements of a buffer of `dtype` kept between steps (grown to powers of two)."""
        buf = getattr(self, name, None)
        if buf is None or len(buf) < n:
            buf = np.empty(1 << max(n - 1, 1).bit_length(), dtype=self.dtype)
            setattr(self, name, buf)
        return buf[:n]

    def _add(self, start: int, n: int) -> None:
        """The next `n` values of the contents are `_values[start: start + n]` (merged with the last
        piece where they follow it)."""
        if n == 0:
            return
        last = self._pieces[-1] if self._pieces else None
        if last is not None and last[0] + last[1] == start:
            last[1] += n
        else:
            self._pieces.append([start, n])
        self._len += n


def install(req_states) -> bool:
    """A relay engine's runner: its `RequestState.all_token_ids` stages into a `StagedChunks`. Only where
    the values reach the GPU through numpy (its UVA path, vLLM's default; with a dense GPU copy, as
    n-gram drafting on the GPU makes, torch converts them as a sequence). Whether it was installed."""
    tensor = getattr(req_states, "all_token_ids", None)
    if getattr(tensor, "write_contents", None) is None or not isinstance(
            getattr(tensor, "_staged_write_contents", None), list):
        return False
    import torch

    dtype = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}.get(tensor.dtype)
    swap(tensor, "_staged_write_contents", StagedChunks(dtype))
    return True
