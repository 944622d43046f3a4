"""A seeded fuzzer over pickle opcodes for the restricted `.metadata` reader.

Two sources of inputs: programs generated from the whole opcode set (protocols 0-5: every
push, container, memo, call and BUILD opcode) around DCP's admitted globals, biased towards
what amplifies work (one big value built once, then referenced from the memo and copied,
hashed or used as a key again and again), and mutations of real `.metadata` files (byte
flips, opcode swaps, repeated slices, spliced programs, truncation).

Run as a module it reads inputs and reports one JSON line each (outcome, CPU seconds, budget
units), then the peak RSS; `tests/format/test_restricted_reader_is_bounded.py` drives it in a fresh interpreter,
so a crash of the interpreter is seen as one too:

    python -m tests.helpers.pickle_fuzz SEED COUNT MAX_BYTES BUDGET_BASE [SEED_FILE ...]

BUDGET_BASE replaces the fixed part of the budget (`safe_read.budget.BUDGET_BASE`): smaller, the
inputs that spend all of it stay quick, and what is checked (work follows the charge) is the same.
"""

from __future__ import annotations

import json
import random
import resource
import struct
import sys
import time

DCP = "torch.distributed.checkpoint.metadata"
GLOBALS = [
    (DCP, "Metadata"), (DCP, "TensorStorageMetadata"), (DCP, "BytesStorageMetadata"),
    (DCP, "ChunkStorageMetadata"), (DCP, "TensorProperties"), (DCP, "MetadataIndex"), (DCP, "StorageMeta"),
    (DCP, "_MEM_FORMAT_ENCODING"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("torch", "float32"), ("torch", "bfloat16"), ("torch._utils", "torch.contiguous_format"),
    # refused ones: the reader must say so, whatever surrounds them
    ("builtins", "getattr"), ("os", "system"), ("builtins", "list"), ("torch", "load"),
]
RECORDS = [g for g in GLOBALS[:9] if g[1] not in ("_MEM_FORMAT_ENCODING",)]
FIELDS = ["fqn", "offset", "index", "offsets", "sizes", "properties", "size", "chunks", "state_dict_metadata",
          "storage_data", "planner_data", "relative_path", "length", "dtype", "_private", "__class__"]
_P = 2 ** 61 - 1  # ints this far apart share a hash


class Program:
    """Emits opcodes that (mostly) leave one value per `value()` call on the stack."""

    def __init__(self, rng: random.Random, max_bytes: int) -> None:
        self.rng, self.max_bytes = rng, max_bytes
        self.out = bytearray(b"\x80" + bytes([rng.choice([2, 3, 4, 5])]))
        self.memo = 0

    def full(self) -> bool:
        return len(self.out) > self.max_bytes

    def emit(self, b: bytes) -> None:
        self.out += b

    def memoize(self) -> int:
        r = self.rng.random()
        if r < 0.5:
            self.emit(b"\x94")  # MEMOIZE
        elif r < 0.75:
            self.emit(b"q" + bytes([self.memo % 256]) if self.memo < 256 else b"r" + struct.pack("<I", self.memo))
        else:
            self.emit(b"p" + str(self.memo).encode() + b"\n")  # text PUT
        self.memo += 1
        return self.memo - 1

    def get(self, index: int) -> None:
        r = self.rng.random()
        if index < 256 and r < 0.5:
            self.emit(b"h" + bytes([index]))
        elif r < 0.85:
            self.emit(b"j" + struct.pack("<I", index))
        else:
            self.emit(b"g" + str(index).encode() + b"\n")

    def glob(self, pair=None) -> None:
        module, name = pair or self.rng.choice(GLOBALS)
        if self.rng.random() < 0.5:
            self.emit(b"c" + module.encode() + b"\n" + name.encode() + b"\n")
        else:
            self.string(module)
            self.string(name)
            self.emit(b"\x93")  # STACK_GLOBAL

    def string(self, text: str) -> None:
        raw = text.encode()
        r = self.rng.random()
        if r < 0.4 and len(raw) < 256:
            self.emit(b"\x8c" + bytes([len(raw)]) + raw)
        elif r < 0.8:
            self.emit(b"X" + struct.pack("<I", len(raw)) + raw)
        else:
            self.emit(b"V" + raw.replace(b"\\", b"").replace(b"\n", b"") + b"\n")

    def integer(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.3:
            self.emit(b"K" + bytes([rng.randrange(256)]))
        elif r < 0.5:
            self.emit(b"J" + struct.pack("<i", rng.randrange(-2**31, 2**31)))
        elif r < 0.7:
            v = rng.randrange(1, 40) * _P * rng.choice([1, -1])  # colliding hashes
            raw = v.to_bytes(v.bit_length() // 8 + 1, "little", signed=True)
            self.emit(b"\x8a" + bytes([len(raw)]) + raw)
        elif r < 0.8:
            self.emit(b"I" + str(rng.randrange(-10**6, 10**6)).encode() + b"\n")
        elif r < 0.9:
            self.emit(b"L" + str(rng.randrange(0, 10**30)).encode() + b"L\n")
        else:
            self.emit(b"M" + struct.pack("<H", rng.randrange(65536)))

    def value(self, depth: int = 0) -> None:
        """Push one value."""
        rng = self.rng
        if self.full() or depth > 6:
            self.emit(rng.choice([b"N", b"\x88", b"\x89", b"K\x01"]))
            return
        choice = rng.random()
        if choice < 0.15:
            self.integer()
        elif choice < 0.22:
            self.string(rng.choice(FIELDS + ["x" * rng.randrange(1, 64)]))
        elif choice < 0.25:
            self.emit(rng.choice([b"N", b"\x88", b"\x89", b"G" + struct.pack(">d", rng.random()),
                                  b"C\x03abc", b"B" + struct.pack("<I", 2) + b"hi", b"\x96" + struct.pack("<Q", 3)
                                  + b"xyz"]))
        elif choice < 0.35 and self.memo:
            self.get(rng.randrange(self.memo))
            return
        elif choice < 0.45:
            self.sequence(depth)
        elif choice < 0.52:
            self.mapping(depth)
        elif choice < 0.58:
            self.emit(b"(" if rng.random() < 0.5 else b"\x8f")
            if self.out[-1:] == b"(":
                self.items(depth, rng.randrange(0, 6))
                self.emit(b"\x91")  # FROZENSET
            else:  # EMPTY_SET, then ADDITEMS
                self.emit(b"(")
                self.items(depth, rng.randrange(0, 6))
                self.emit(b"\x90")
        elif choice < 0.78:
            self.call(depth)
        elif choice < 0.86:
            self.record(depth)
        elif choice < 0.93:
            self.big()
        else:
            self.glob()
        if rng.random() < 0.4:
            self.memoize()

    def items(self, depth: int, n: int) -> None:
        for _ in range(n):
            self.value(depth + 1)

    def sequence(self, depth: int) -> None:
        rng = self.rng
        n = rng.randrange(0, 6)
        kind = rng.random()
        if kind < 0.3 and n <= 3:
            self.items(depth, n)
            self.emit([b")", b"\x85", b"\x86", b"\x87"][n])
        elif kind < 0.6:
            self.emit(b"(")
            self.items(depth, n)
            self.emit(b"t" if rng.random() < 0.5 else b"l")
        else:
            self.emit(b"]" if rng.random() < 0.7 else b"(l")
            self.emit(b"(")
            self.items(depth, n)
            self.emit(b"e")

    def mapping(self, depth: int) -> None:
        rng = self.rng
        if rng.random() < 0.3:
            self.emit(b"(")
            for _ in range(rng.randrange(0, 4)):
                self.value(depth + 1)
                self.value(depth + 1)
            self.emit(b"d")
            return
        self.emit(b"}")
        if rng.random() < 0.3:
            self.value(depth + 1)
            self.value(depth + 1)
            self.emit(b"s")
        else:
            self.emit(b"(")
            for _ in range(rng.randrange(0, 4)):
                self.value(depth + 1)
                self.value(depth + 1)
            self.emit(b"u")

    def call(self, depth: int) -> None:
        rng = self.rng
        kind = rng.random()
        n = rng.randrange(0, 3)
        if kind < 0.45:  # REDUCE
            self.glob()
            self.emit(b"(")
            self.items(depth, n)
            self.emit(b"t" + b"R")
        elif kind < 0.6:  # OBJ
            self.emit(b"(")
            self.glob()
            self.items(depth, n)
            self.emit(b"o")
        elif kind < 0.7:  # INST
            module, name = rng.choice(GLOBALS)
            self.emit(b"(")
            self.items(depth, n)
            self.emit(b"i" + module.encode() + b"\n" + name.encode() + b"\n")
        elif kind < 0.9:  # NEWOBJ
            self.glob()
            self.emit(b"(")
            self.items(depth, n)
            self.emit(b"t\x81")
        else:  # NEWOBJ_EX
            self.glob()
            self.emit(b"(")
            self.items(depth, n)
            self.emit(b"t}(")
            for _ in range(rng.randrange(0, 2)):
                self.string(rng.choice(FIELDS))
                self.value(depth + 1)
            self.emit(b"u\x92")

    def record(self, depth: int) -> None:
        rng = self.rng
        self.glob(rng.choice(RECORDS))
        self.emit(b")\x81")
        if rng.random() < 0.2 and self.memo:
            self.get(rng.randrange(self.memo))  # any state, shared
        else:
            self.emit(b"}(")
            for _ in range(rng.randrange(0, 4)):
                self.string(rng.choice(FIELDS))
                self.value(depth + 1)
            self.emit(b"u")
        self.emit(b"b")

    def big(self) -> None:
        """One large value, memoized, then used over and over: the shapes amplification takes."""
        rng = self.rng
        n = rng.choice([100, 1000, 5000, 20000])
        self.emit(b"(" + b"K\x01" * n + rng.choice([b"l", b"t"]))
        big = self.memoize()
        if rng.random() < 0.5:  # wrap it as a torch.Size, a frozenset or a key record first
            self.glob(rng.choice([("torch", "Size"), ("builtins", "frozenset"), ("builtins", "set")]))
            self.get(big)
            self.emit(b"\x85R")
            big = self.memoize()
        uses = rng.choice([10, 100, 1000, 5000])
        use = rng.random()
        self.emit(b"(")
        if use < 0.2:  # as a dict key, again and again
            self.emit(b"}(")
            for i in range(uses):
                self.get(big)
                self.emit(b"K" + bytes([i % 256]))
            self.emit(b"u")
        elif use < 0.4:  # copied by a call, again and again (REDUCE / OBJ / NEWOBJ)
            cls = rng.choice([("torch", "Size"), ("builtins", "frozenset"), ("builtins", "set"),
                              ("collections", "OrderedDict"), (DCP, "MetadataIndex"), ("pathlib", "PosixPath")])
            self.glob(cls)
            fn = self.memoize()
            op = rng.choice([b"R", b"o", b"\x81"])
            for _ in range(uses):
                if op == b"o":
                    self.emit(b"(")
                    self.get(fn)
                    self.get(big)
                    self.emit(b"o")
                else:
                    self.get(fn)
                    self.get(big)
                    self.emit(b"\x85" + op)
        elif use < 0.55:  # as a set element
            self.emit(b"(")
            for _ in range(uses):
                self.get(big)
            self.emit(b"\x91")
        elif use < 0.7:  # as the state of records
            self.glob(rng.choice(RECORDS))
            cls = self.memoize()
            for _ in range(uses):
                self.get(cls)
                self.emit(b")\x81")
                self.get(big)
                self.emit(b"b")
        elif use < 0.85:  # as the argument of a lookup
            self.glob(rng.choice([(DCP, "_MEM_FORMAT_ENCODING"), ("torch.serialization", "_get_layout")]))
            fn = self.memoize()
            for _ in range(uses):
                self.get(fn)
                self.get(big)
                self.emit(b"\x85R")
        else:  # DUP and nesting
            self.get(big)
            for _ in range(min(uses, 200)):
                self.emit(b"2\x86")  # DUP, TUPLE2: t = (t, t)
            self.emit(b"}" + b"N" + b"s")  # that doubled tuple as a key would be 2**uses leaves
            self.emit(b"0")
        self.emit(b"l")


def generate(rng: random.Random, max_bytes: int) -> bytes:
    prog = Program(rng, max_bytes)
    if rng.random() < 0.7:  # a Metadata around a generated index
        prog.glob((DCP, "Metadata"))
        prog.emit(b"(")
        prog.mapping(0)
        prog.value(1)
        prog.emit(b"tR")
    else:
        prog.value(0)
    while not prog.full() and rng.random() < 0.6:
        prog.value(0)
        prog.emit(b"0")  # POP: stray values are dropped
    prog.emit(b".")
    return bytes(prog.out)


_OPCODES = [op.code.encode("latin-1") for op in __import__("pickletools").opcodes]


def mutate(rng: random.Random, data: bytes, max_bytes: int) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        if not out:
            break
        kind = rng.random()
        i = rng.randrange(len(out))
        if kind < 0.25:
            out[i] = rng.randrange(256)
        elif kind < 0.45:
            out[i:i + 1] = rng.choice(_OPCODES)
        elif kind < 0.7:  # repeat a slice (opcodes that refer to the memo get run again and again)
            j = min(len(out), i + rng.randrange(1, 64))
            out[j:j] = bytes(out[i:j]) * rng.randrange(2, 200)
        elif kind < 0.85:  # splice a generated program in
            out[i:i] = generate(rng, 2048)[2:-1]
        elif kind < 0.95:
            del out[i:i + rng.randrange(1, 32)]
        else:
            del out[i:]
    return bytes(out[:max_bytes])


def inputs(seed: int, count: int, max_bytes: int, seeds: list[bytes]):
    rng = random.Random(seed)
    for n in range(count):
        if seeds and n % 2:
            yield mutate(rng, rng.choice(seeds), max_bytes)
        else:
            yield generate(rng, rng.choice([256, 2048, max_bytes]))


def _tools(data: bytes) -> str | None:
    """verify and inspect on a directory holding ``data`` as its index; a crash, or None."""
    import tempfile

    from safe_ckpt.tools import inspect
    from safe_ckpt.encoding import safe_read as safe_load
    from safe_ckpt.tools import verify

    with tempfile.TemporaryDirectory() as directory:
        with open(f"{directory}/.metadata", "wb") as f:
            f.write(data)
        with open(f"{directory}/metadata.json", "w") as f:
            f.write('{"sharded_backend": "torch_dist"}')
        try:
            verify.verify(directory, deep=True)
            inspect.inspect(directory)
        except safe_load.UnreadableCheckpointError:
            pass
        except BaseException as exc:  # noqa: BLE001 - the report says what escaped
            return f"crash in the tools {type(exc).__name__}: {str(exc)[:200]}"
    return None


def main(argv: list[str]) -> int:
    seed, count, max_bytes, budget_base = (int(v) for v in argv[:4])
    seeds = [open(path, "rb").read() for path in argv[4:]]
    from safe_ckpt.encoding import safe_read as safe_load

    try:
        from safe_ckpt.encoding.safe_read import budget as metadata_budget
    except ImportError:  # a reader without a work budget: outcomes and times only
        metadata_budget = None
    else:
        metadata_budget.BUDGET_BASE = budget_base
    import torch.distributed.checkpoint.metadata  # noqa: F401  (imported before the baseline)
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    budget_seen = {}
    if metadata_budget is not None:
        class Recording(metadata_budget.WorkBudget):
            def __init__(self, path, size_bytes):
                super().__init__(path, size_bytes)
                budget_seen["b"] = self

        safe_load.WorkBudget = Recording
    for n, data in enumerate(inputs(seed, count, max_bytes, seeds)):
        t0 = time.process_time()
        try:
            safe_load.metadata_from_bytes(data, "fuzz")
            outcome = "read"
        except safe_load.UnreadableCheckpointError:
            outcome = "refused"
        except BaseException as exc:  # noqa: BLE001 - the report says what escaped
            outcome = f"crash {type(exc).__name__}: {str(exc)[:200]}"
        cpu_s = time.process_time() - t0
        if outcome == "read":  # what verify and inspect then walk must hold up too
            outcome = _tools(data) or outcome
        budget = budget_seen.pop("b", None)
        print(json.dumps({"n": n, "bytes": len(data), "outcome": outcome, "cpu_s": round(cpu_s, 4),
                          "units": budget.used if budget else 0, "budget": budget.total if budget else 0,
                          "input": data.hex() if outcome.startswith("crash") else None}), flush=True)
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline_kib
    print(json.dumps({"peak_rss_growth_mib": grew / 1024}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
