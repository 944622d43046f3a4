"""What hashing a key from an untrusted `.metadata` into a dict or set costs, charged before it is done.

One job: for the restricted unpickler (`unpickler.MetadataUnpickler` mixes this in), price each key
at what hashing and comparing it walks (`weight`), times the keys with the same hash but another
value seen before (crafted collisions make each insert compare against all of them), and charge
that to the reader's work budget; refuse a key nested deeper than any DCP record. str and bytes
keys are hashed with a per-process key: their collisions cannot be crafted.
Must not: hash anything it has not priced, or build objects.
"""

from __future__ import annotations

import pathlib

import torch

# Hashing a tuple recurses in C without a depth check (deep enough, the interpreter crashes): a key
# nested deeper than this is refused. DCP's deepest key, a MetadataIndex, is 3 deep.
MAX_KEY_DEPTH = 64
# Budget units (see `unpickler`) per key:
_PER_STR_KEY = 2  # a str key checked (its hash is keyed per process: no collisions to track)
_PER_KEY = 10  # any other key: its weight, its hash, the record of keys with that hash


class KeyCharges:
    """Key pricing for an unpickler with ``_budget``, ``_weights``, ``_hashes``, ``_hashable_records``
    and ``_refuse``."""

    def weight(self, obj, depth: int = 0) -> int:
        """Element operations one hash or comparison of ``obj`` takes (hashes of str, bytes, Paths and
        frozensets are cached by Python, but comparing two equal ones walks them)."""
        t = type(obj)
        if t is str or t is bytes:
            return 1 + (len(obj) >> 4)
        if t is int:
            return 1 + (obj.bit_length() >> 6)
        if t is torch.Size:  # its elements are int64
            return 1 + len(obj)
        if not (t is tuple or t is frozenset or t is memoryview or isinstance(obj, self._hashable_records)
                or isinstance(obj, pathlib.PurePath)):
            return 1
        known = self._weights.get(id(obj))
        if known is not None:
            return known[1]
        if depth >= MAX_KEY_DEPTH:
            self._refuse(f"refused: it holds a tuple or record nested more than {MAX_KEY_DEPTH} deep as a key, which "
                         f"a DCP metadata file never does; not unpickled")
        if t is tuple:
            w = 1 + sum(self.weight(item, depth + 1) for item in obj)
        elif t is frozenset:
            w = 1 + len(obj)
        elif t is memoryview:  # compared item by item
            w = 1 + obj.nbytes
        elif isinstance(obj, pathlib.PurePath):  # compared part by part
            w = 1 + len(str(obj))
        else:  # a hashable record (MetadataIndex): hashed by its fields
            w = 1
            for value in vars(obj).values():  # the leaves `weight` prices first, priced here the same
                tv = type(value)
                if tv is str or tv is bytes:
                    w += 1 + (len(value) >> 4)
                elif tv is torch.Size:
                    w += 1 + len(value)
                elif value is None:
                    w += 1
                else:
                    w += self.weight(value, depth + 1)
        if w > self._budget.total:
            self._refuse(f"refused: it holds a tuple or record of {w} elements in all (shared parts counted "
                         f"each time they occur), which a DCP metadata file of its size never does; not unpickled")
        self._weights[id(obj)] = (obj, w)
        return w

    def _insert(self, key, what) -> None:
        """Charge hashing ``key`` into a dict or set: its weight, times one more for each key with the
        same hash but another value seen before (each is compared against it)."""
        t = type(key)
        if t is str or t is bytes:  # hashed with a per-process key: collisions cannot be crafted
            self._budget.charge(_PER_STR_KEY + (len(key) >> 4), what)
            return
        w = self.weight(key)
        self._budget.charge(_PER_KEY + w, what)
        try:
            h = hash(key)
        except TypeError:  # unhashable: the container raises
            return
        seen = self._hashes.get(h)
        if seen is None:
            self._hashes[h] = [key, 0]
            return
        first = seen[0]
        if first is key:
            return
        try:
            same = bool(first == key)
        except Exception:  # RecursionError and kin: count it as a collision
            same = False
        if not same:
            seen[1] += 1
            self._budget.charge(w * seen[1], what)

    def _keys(self, keys, what) -> None:
        strings = 0
        for key in keys:
            if type(key) is str:
                strings += _PER_STR_KEY + (len(key) >> 4)
            else:
                self._insert(key, what)
        self._budget.charge(strings, what)
