"""Unpickling a DCP `.metadata` someone may have crafted: DCP's classes only, within one work budget.

One job: turn the bytes of a `.metadata` into objects with Python's own pure-Python
unpickler (its memo is a dict: a huge memo index costs nothing), resolving only the
globals a DCP metadata file holds (ADMITTED_GLOBALS, found by disassembling files written
by stock DCP, stock Megatron and this library in torch 2.6-2.14, and from torch's sources
for moved classes), letting BUILD set fields only on DCP's records, and charging every
operation that can cost more than its own opcode bytes to one `WorkBudget` sized from the
file: a call that copies or hashes its arguments (OBJ, INST, REDUCE, NEWOBJ, NEWOBJ_EX),
BUILD copying a state, every key hashed into a dict or set (SETITEM(S), DICT, ADDITEMS,
FROZENSET, and the calls set/frozenset/OrderedDict) at what hashing and comparing it walks,
times the keys with the same hash seen before (crafted collisions make each insert compare
against all of them). What costs no more than its bytes (pushing a value, a memo or DUP
reference, a tuple or list of stack items) is bounded by the file's size, uncharged. Past
the budget, or for a key nested deeper than any DCP record, the file is refused.
Must not: resolve a global outside ADMITTED_GLOBALS (and torch's dtype, layout and
memory-format constants), or call anything but what those name.
"""

from __future__ import annotations

import importlib
import io
import pathlib
import pickle
import reprlib
import struct
import types

import torch

from ...errors import UnreadableCheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# torch < 2.2 pickled TensorProperties from its old home; torch still defines it there.
_SHARD_METADATA = "torch.distributed._shard.sharded_tensor.metadata"
_PATH_CLASSES = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")

# The DCP records a legitimate file sets the state of (BUILD); nothing else, and no class, ever is.
_RECORDS = (
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"), (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"), (_DCP_METADATA, "MetadataIndex"), (_DCP_METADATA, "StorageMeta"),
    (_SHARD_METADATA, "TensorProperties"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)
# Records of another package, resolved only when a file names them (importing megatron.core costs
# seconds): megatron-core 0.15 pickles its own Metadata subclass, one more field of plain data.
_FOREIGN_RECORDS = (("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),)
# Callables that hash what their argument holds (a set's elements, a mapping's keys) ...
_HASH_ELEMENTS = frozenset({("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict")})
# ... and that hash the argument itself (a lookup by value or name).
_HASH_ARGUMENT = frozenset({(_DCP_METADATA, "_MEM_FORMAT_ENCODING"), (_SHARD_METADATA, "MEM_FORMAT_ENCODING"),
                            ("torch.serialization", "_get_layout")})

# Every (module, name) a legitimate `.metadata` references, besides torch's dtype, layout and
# memory-format constants (matched by type in `torch_constant`). Each one is data: a dataclass whose
# state is set by BUILD or a `__setstate__` that only assigns fields, or a callable that maps a plain
# value to a constant, or a container.
ADMITTED_GLOBALS = frozenset({
    *_RECORDS,
    *_FOREIGN_RECORDS,
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties pickles its memory format as this enum
    (_SHARD_METADATA, "MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout's reducer: a name -> layout lookup
    ("collections", "OrderedDict"),
    ("builtins", "set"),  # sets in pickle protocols < 4
    ("builtins", "frozenset"),
    # StorageMeta.checkpoint_id is the Path a stock DCP save was given (pathlib._local: Python >= 3.13)
    *(("pathlib", name) for name in _PATH_CLASSES),
    *(("pathlib._local", name) for name in _PATH_CLASSES),
})

# Hashing a tuple recurses in C without a depth check (deep enough, the interpreter crashes): a key
# nested deeper than this is refused. DCP's deepest key, a MetadataIndex, is 3 deep.
MAX_KEY_DEPTH = 64
# The budget is in units of about one element copied or hashed in C (~50 ns, ~8 bytes of memory);
# work done element by element in Python costs more units per element:
_PER_STR_KEY = 2  # a str key checked (its hash is keyed per process: no collisions to track)
_PER_KEY = 10  # any other key: its weight, its hash, the record of keys with that hash
_PER_FIELD = 8  # a state entry BUILD sets, by Python code, into a new __dict__
_PER_PATH_CHAR = 8  # a Path splits its string into part objects
_PER_EMPTY_SET = 28  # a 1-byte opcode making a 216-byte object
# For a file of n bytes: BUDGET_PER_BYTE * n + BUDGET_BASE. Files written by stock DCP, stock Megatron
# and this library use under 1 per byte (`tests/test_reader_budget.py` measures it); what is not
# charged (pushing values, memo entries) costs at most about 75 bytes of memory per byte of file.
BUDGET_PER_BYTE = 8
BUDGET_BASE = 1 << 22
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


def torch_constant(module: str, name: str):
    """torch.float32 (`torch`, `float32`), torch.strided, torch.contiguous_format (`torch._utils`,
    `torch.contiguous_format`, as torch's reducer names it), or None."""
    if module == "torch":
        attr = name
    elif module == "torch._utils" and name.startswith("torch."):
        attr = name[len("torch."):]
    else:
        return None
    value = getattr(torch, attr, None) if attr.isidentifier() else None
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


def budget_for(size_bytes: int) -> int:
    return BUDGET_PER_BYTE * size_bytes + BUDGET_BASE


class WorkBudget:
    """Element operations left for reading one file (its unpickling and the checks after it)."""

    def __init__(self, path: str, size_bytes: int) -> None:
        self.path, self.size_bytes = path, size_bytes
        self.total = self.left = budget_for(size_bytes)

    @property
    def used(self) -> int:
        return self.total - self.left

    def charge(self, units: int, what) -> None:
        """Spend ``units``; past the budget, refuse the file. ``what`` (a string, or a callable or class
        whose call it is) names the operation in the message."""
        self.left -= units
        if self.left < 0:
            if not isinstance(what, str):
                what = f"a call of {getattr(what, '__qualname__', type(what).__name__)}"
            raise UnreadableCheckpointError(
                self.path, f"refused: building it copies or hashes more elements than a DCP metadata file of its "
                           f"size holds ({self.total} for {self.size_bytes} bytes; exceeded at {what}); not read "
                           f"further")


def _resolve(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _loaded(pairs) -> tuple:
    found = []
    for module, name in pairs:
        try:
            found.append(_resolve(module, name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


class MetadataUnpickler(pickle._Unpickler):
    """Python's own unpickler with globals restricted to ADMITTED_GLOBALS, BUILD restricted to DCP
    records, and every copy and hash charged to ``budget``."""

    def __init__(self, data: bytes, path: str, budget: WorkBudget | None = None) -> None:
        self._data, self._size_bytes = io.BytesIO(data), len(data)
        super().__init__(self._data)
        self._path = path
        self._budget = budget if budget is not None else WorkBudget(path, len(data))
        self._records = _loaded(_RECORDS)
        self._hashable_records = tuple(cls for cls in self._records if cls.__hash__ is not None)
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

    # ------------------------------------------------------------------ what hashing an object walks
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
            w = 1 + sum(self.weight(value, depth + 1) for value in vars(obj).values())
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
        read, dispatch = data.read, self.dispatch
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
        self._keys(self.stack[0::2], "a dict key")
        pickle._Unpickler.load_setitems(self)

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
