"""Unpickling a DCP `.metadata` someone may have crafted: DCP's classes only, within one work budget.

One job: turn the bytes of a `.metadata` into objects with Python's own pure-Python
unpickler (its memo is a dict: a huge memo index costs nothing), resolving only the
globals a DCP metadata file holds (`admitted.ADMITTED_GLOBALS`), letting BUILD set fields
only on DCP's records, and charging every
operation that can cost more than its own opcode bytes to one `budget.WorkBudget` sized from the
file: a call that copies or hashes its arguments (OBJ, INST, REDUCE, NEWOBJ, NEWOBJ_EX),
BUILD copying a state, every key hashed into a dict or set (SETITEM(S), DICT, ADDITEMS,
FROZENSET, and the calls set/frozenset/OrderedDict) at what hashing and comparing it walks,
times the keys with the same hash seen before (`keys`). What costs no more than its bytes
(pushing a value, a memo or DUP reference, a tuple or list of stack items) is bounded by the
file's size, uncharged. Past
the budget, or for a key nested deeper than any DCP record, the file is refused.
Must not: resolve a global outside ADMITTED_GLOBALS (and torch's dtype, layout and
memory-format constants), or call anything but what those name.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import reprlib
import struct
import sys
import types

import torch

from ...errors import UnreadableCheckpointError
from .admitted import (
    _FOREIGN_RECORDS, _HASH_ARGUMENT, _HASH_ELEMENTS, _PATH_CLASSES, _RECORDS, ADMITTED_GLOBALS, _loaded, _resolve,
    torch_constant,
)
from .budget import WorkBudget
from .keys import KeyCharges

# The budget (`budget`) is in units of about one element copied or hashed in C (~50 ns, ~8 bytes of
# memory); work done element by element in Python costs more units per element:
_PER_FIELD = 8  # a state entry BUILD sets, by Python code, into a new __dict__
_PER_PATH_CHAR = 8  # a Path splits its string into part objects
_PER_EMPTY_SET = 28  # a 1-byte opcode making a 216-byte object
# Memo indices a pickler writes count up from 0; a text PUT/GET could name any int (and ints
# 2**61 - 1 apart share a hash: a memo of such indices fills quadratically).
_MAX_MEMO_INDEX = 1 << 32
# Text ints (protocols 0 and 1) parse in time quadratic in their digits when Python's own limit
# (sys.set_int_max_str_digits) is lifted.
_MAX_INT_TEXT = 4300
_SIZED = (str, bytes, bytearray, tuple, list, dict, set, frozenset)
_CALLABLES = (type, types.FunctionType)

_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80


def _plain(records: tuple) -> frozenset:
    """The records whose BUILD puts a dict's items into the instance's ``__dict__`` (no ``__setstate__``)."""
    return frozenset(cls for cls in records if getattr(cls, "__setstate__", None) is None)


def show(value) -> str:
    """A bounded repr of a value from an untrusted file: builtin values truncated, anything else by type."""
    if type(value) is int and value.bit_length() > 256:  # repr of a huge int is quadratic
        return f"<int of {value.bit_length()} bits>"
    if isinstance(value, (str, bytes, int, float, bool, tuple, list, dict, set, frozenset, type(None))):
        try:
            return _SHOW.repr(value)
        except (RecursionError, ValueError):  # ValueError: an int past the digits str() converts
            pass
    return f"<{type(value).__name__}>"


class MetadataUnpickler(KeyCharges, pickle._Unpickler):
    """Python's own unpickler with globals restricted to ADMITTED_GLOBALS, BUILD restricted to DCP
    records, and every copy and hash charged to ``budget``."""

    def __init__(self, data: bytes, path: str, budget: WorkBudget | None = None) -> None:
        self._data, self._size_bytes = io.BytesIO(data), len(data)
        super().__init__(self._data)
        self._path = path
        self._budget = budget if budget is not None else WorkBudget(path, len(data))
        self._records = _loaded(_RECORDS)
        self._hashable_records = tuple(cls for cls in self._records if cls.__hash__ is not None)
        self._plain_records = _plain(self._records)
        self._weights: dict[int, tuple[object, int]] = {}  # id -> (the object, kept alive; its weight)
        self._hashes: dict[int, list] = {}  # hash -> [first key with it, how many unequal keys followed]
        self._kinds: dict[object, str] = {}  # a resolved callable -> "elements" / "argument" / "path"

    def _refuse(self, message: str, refused_global: str | None = None):
        raise UnreadableCheckpointError(self._path, message, refused_global)

    def find_class(self, module: str, name: str):
        constant = torch_constant(module, name)
        if constant is not None:
            return constant
        if (module, name) not in ADMITTED_GLOBALS:
            self._refuse(f"refused: it references the global {module}.{name}, which a DCP metadata file "
                         f"never holds; not unpickled (nothing from it was run)", f"{module}.{name}")
        try:
            found = _resolve(module, name)
        except (ImportError, AttributeError) as exc:
            self._refuse(f"references {module}.{name}, which the installed torch does not have "
                         f"(written by another torch version?): {exc}")
        if (module, name) in _FOREIGN_RECORDS and found not in self._records:
            self._records += (found,)
            self._plain_records = _plain(self._records)
            if found.__hash__ is not None:
                self._hashable_records += (found,)
        if (module, name) in _HASH_ELEMENTS:
            self._kinds[found] = "elements"
        elif (module, name) in _HASH_ARGUMENT:
            self._kinds[found] = "argument"
        elif name in _PATH_CLASSES:
            self._kinds[found] = "path"
        return found

    def persistent_load(self, pid):
        self._refuse("refused: holds a persistent id, which a DCP metadata file never does")

    # ------------------------------------------------------------------ calls
    def _call(self, func, args, kwargs, new: bool):
        """``func(*args, **kwargs)`` (``func.__new__(func, ...)`` for NEWOBJ), charged for what it copies
        and hashes: each argument's elements; for set / frozenset / OrderedDict, hashing each element or
        key; for the enum and layout lookups, hashing the argument."""
        if type(args) is not tuple or (kwargs is not None and type(kwargs) is not dict):
            self._refuse(f"refused: it calls {show(func)} with arguments that are a {type(args).__name__}, not a "
                         f"tuple, which a DCP metadata file never does; not unpickled")
        # only a class or function is looked up: hashing anything else (a tuple) could be the attack
        kind = self._kinds.get(func) if isinstance(func, _CALLABLES) else None
        values = args + tuple(kwargs.values()) if kwargs else args
        cost = 1 + len(values)
        if kind == "argument":
            for value in values:
                cost += self.weight(value)
        else:
            per_char = _PER_PATH_CHAR if kind == "path" else 1
            for value in values:
                if isinstance(value, (str, bytes)):
                    cost += per_char * len(value)
                elif isinstance(value, _SIZED):
                    cost += len(value)
                elif isinstance(value, pathlib.PurePath):
                    cost += per_char * len(str(value))
        budget = self._budget
        budget.left -= cost
        if budget.left < 0:
            budget.charge(0, func)
        if kind == "elements":
            for value in values:
                if isinstance(value, dict):
                    self._keys(value, func)
                elif isinstance(value, (tuple, list, set, frozenset)):
                    for item in value:
                        self._insert(item, func)
                        if type(item) in (tuple, list) and len(item) == 2:  # OrderedDict hashes a pair's key
                            self._insert(item[0], func)
        if kwargs:
            self._keys(kwargs, func)
            return func.__new__(func, *args, **kwargs) if new else func(*args, **kwargs)
        return func.__new__(func, *args) if new else func(*args)

    def load(self):
        """`pickle._Unpickler.load` reading opcodes straight from the bytes: a frame (protocol 4+) only
        groups opcodes, so its bounds are not kept (the per-read frame bookkeeping was a fifth of the time)."""
        data = self._data
        self.read, self.readline, self.readinto = data.read, data.readline, data.readinto
        self.metastack, self.stack = [], []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = data.read, dict(self.dispatch)  # a plain dict: a lookup per opcode, through no proxy
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:
            return stop.value

    def load_frame(self):
        frame_bytes, = struct.unpack("<Q", self.read(8))
        if frame_bytes > self._size_bytes - self._data.tell():
            raise pickle.UnpicklingError("a frame larger than what follows it")

    def load_reduce(self):
        stack = self.stack
        args = stack.pop()
        stack[-1] = self._call(stack[-1], args, None, new=False)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._call(cls, args, None, new=True))

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._call(cls, args, kwargs, new=True))

    def _instantiate(self, klass, args):  # OBJ and INST
        new = not args and isinstance(klass, type) and not hasattr(klass, "__getinitargs__")
        self.append(self._call(klass, tuple(args), None, new=new))

    # ------------------------------------------------------------------ containers
    def load_setitem(self):
        if len(self.stack) >= 2:
            self._keys((self.stack[-2],), "a dict key")
        pickle._Unpickler.load_setitem(self)

    def load_setitems(self):  # the items since the last MARK are the whole current stack
        items = self.stack
        self._keys(items[0::2], "a dict key")
        self.pop_mark()
        target = self.stack[-1]
        if type(target) is dict and not len(items) & 1:  # pickle's loop, in one call
            target.update(zip(items[0::2], items[1::2]))
        else:
            for i in range(0, len(items), 2):
                target[items[i]] = items[i + 1]

    def load_dict(self):
        self._keys(self.stack[0::2], "a dict key")
        pickle._Unpickler.load_dict(self)

    def load_empty_set(self):
        self._budget.charge(_PER_EMPTY_SET, "EMPTY_SET")
        self.append(set())

    def load_additems(self):
        self._keys(self.stack, "a set element")
        pickle._Unpickler.load_additems(self)

    def load_frozenset(self):
        self._keys(self.stack, "a set element")
        pickle._Unpickler.load_frozenset(self)

    # ------------------------------------------------------------------ BUILD
    def load_build(self):
        # BUILD's state goes into the object below it by __dict__ update or setattr: on a class that
        # find_class returned it would rewrite the class for the whole process.
        stack = self.stack
        if len(stack) >= 2 and type(stack[-1]) is dict and stack[-1] and type(stack[-2]) in self._plain_records \
                and id(stack[-2]) not in self._weights:
            self._build_fields(stack)
            return
        if len(stack) >= 2:
            state, target = stack[-1], stack[-2]
            if type(target) not in self._records:
                if isinstance(target, type):
                    self._refuse(f"refused: it sets attributes of the class {target.__module__}."
                                 f"{target.__qualname__}, which a DCP metadata file never does; not unpickled")
                self._refuse(f"refused: it sets the state of a {type(target).__qualname__}, which a DCP "
                             f"metadata file only does to its own records; not unpickled")
            if id(target) in self._weights:  # its weight, already counted, would go stale
                self._refuse(f"refused: it sets the state of a {type(target).__qualname__} after using it as a "
                             f"key, which a DCP metadata file never does; not unpickled")
            parts = state if type(state) is tuple and len(state) == 2 else (state,)
            budget = self._budget
            budget.left -= 1 + _PER_FIELD * sum(len(part) for part in parts if isinstance(part, _SIZED))
            if budget.left < 0:
                budget.charge(0, "BUILD")
            for part in parts:
                if isinstance(part, dict):  # its keys become attributes: fields only
                    cost = 0
                    for key in part:
                        if type(key) is not str or key[:1] == "_":
                            self._refuse(f"refused: it sets the attribute {show(key)} of a "
                                         f"{type(target).__qualname__}, which is not a field; not unpickled")
                        cost += len(key) >> 4
                    budget.charge(cost, "BUILD")
        pickle._Unpickler.load_build(self)

    def _build_fields(self, stack) -> None:
        """BUILD of a non-empty field dict into a record without `__setstate__` (almost every BUILD):
        `load_build`'s checks and charges, then pickle's BUILD of such a state without its failing
        `__setstate__` lookup."""
        state, target = stack.pop(), stack[-1]
        budget = self._budget
        budget.left -= 1 + _PER_FIELD * len(state)
        if budget.left < 0:
            budget.charge(0, "BUILD")
        cost = 0
        for key in state:  # its keys become attributes: fields only
            if type(key) is not str or key[:1] == "_":
                self._refuse(f"refused: it sets the attribute {show(key)} of a "
                             f"{type(target).__qualname__}, which is not a field; not unpickled")
            cost += len(key) >> 4
        budget.charge(cost, "BUILD")
        inst_dict = target.__dict__
        for key, value in state.items():
            inst_dict[sys.intern(key)] = value

    # ------------------------------------------------------------------ text memo opcodes
    def _memo_index(self) -> int:
        index = int(self._text_int()[:-1])
        if not 0 <= index < _MAX_MEMO_INDEX:
            self._refuse(f"refused: a memo index of {show(index)}, which no pickler writes; not unpickled")
        return index

    def _text_int(self) -> bytes:
        line = self.readline()
        if len(line) > _MAX_INT_TEXT:
            self._refuse(f"refused: an int written in {len(line)} digits, which no DCP metadata file holds (and "
                         f"parsing it takes time quadratic in its length); not unpickled")
        return line

    def load_int(self):  # pickle._Unpickler.load_int, length-checked
        data = self._text_int()
        self.append(False if data == b"00\n" else True if data == b"01\n" else int(data, 0))

    def load_long(self):  # pickle._Unpickler.load_long, length-checked
        val = self._text_int()[:-1]
        self.append(int(val[:-1] if val[-1:] == b"L" else val, 0))

    def load_put(self):
        self.memo[self._memo_index()] = self.stack[-1]

    def load_get(self):
        self.append(self.memo[self._memo_index()])

    dispatch = types.MappingProxyType({
        **pickle._Unpickler.dispatch,
        pickle.BUILD[0]: load_build,
        pickle.REDUCE[0]: load_reduce,
        pickle.NEWOBJ[0]: load_newobj,
        pickle.NEWOBJ_EX[0]: load_newobj_ex,
        pickle.SETITEM[0]: load_setitem,
        pickle.SETITEMS[0]: load_setitems,
        pickle.DICT[0]: load_dict,
        pickle.ADDITEMS[0]: load_additems,
        pickle.EMPTY_SET[0]: load_empty_set,
        pickle.FROZENSET[0]: load_frozenset,
        pickle.PUT[0]: load_put,
        pickle.GET[0]: load_get,
        pickle.FRAME[0]: load_frame,
        pickle.INT[0]: load_int,
        pickle.LONG[0]: load_long,
    })
