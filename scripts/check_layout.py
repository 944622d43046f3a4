"""The layout rules of safe_ckpt/, checked from the source (run from the repository root).

1. Imports: nothing in safe_ckpt/ imports the lab (safe_ckpt_lab), tests or benchmarks, no
   folder imports one that comes later in the flow than it may (LATER below), and only the
   edges (ENTRY_POINTS and EDGES themselves) import the edges.
2. Sizes: no module of safe_ckpt/ is over MAX_LINES lines (ALLOWED_OVER lists the exceptions
   still being split, each with the step that splits it; the list must end empty).
3. One seam per target: no branch on the kind of target in the orchestrator or the planning
   code (KIND_WORDS must not appear in saving/ or plan/), nor in the tools and the command
   line (no identifier in tools/ or cli/ matches KIND_NAMES, and neither imports one target's
   own folder; KIND_ALLOWED lists the exceptions, each with its reason).
4. On-disk names: the file names of the format appear as literals only in names.py.
Exit 1 and one line per finding on failure. `python scripts/check_layout.py`.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

PACKAGE = "safe_ckpt"
MAX_LINES = 400
ALLOWED_OVER: dict[str, str] = {}  # "safe_ckpt/x.py": "why, and the step that splits it"
OUTSIDE = ("safe_ckpt_lab", "tests", "benchmarks")
# importer folder -> folders (under safe_ckpt) it must not import
LATER = {
    "plan": {"residence", "staging", "encoding", "sinks", "write", "targets", "coord", "saving", "tools", "host",
             "loading"},
    "residence": {"staging", "encoding", "sinks", "write", "targets", "coord", "saving", "tools", "loading"},
    "staging": {"plan", "encoding", "sinks", "write", "targets", "coord", "saving", "tools", "loading"},
    "encoding": {"staging", "sinks", "write", "targets", "coord", "saving", "tools", "loading"},
    "sinks": {"plan", "residence", "staging", "encoding", "write", "targets", "coord", "saving", "tools", "host",
              "loading"},
    "write": {"targets", "coord", "saving", "tools", "loading"},
    "targets": {"plan", "residence", "staging", "write", "coord", "saving", "tools", "loading"},
    "coord": {"plan", "residence", "staging", "encoding", "sinks", "write", "targets", "saving", "tools", "loading"},
    "host": {"plan", "residence", "staging", "encoding", "sinks", "write", "targets", "saving", "tools", "loading"},
    "tools": {"saving", "write", "staging", "coord", "loading"},
    # reading a checkpoint back: its own plan and reads; nothing of the save's orchestration
    "loading": {"saving", "write", "plan", "residence", "tools"},
    "saving": {"loading", "tools"},
}
EDGES = {"megatron", "integrations", "cli"}  # only the edges, the package and ENTRY_POINTS may import these
ENTRY_POINTS = {"", "__main__", "bench"}  # safe_ckpt/__init__, python -m safe_ckpt, python -m safe_ckpt.bench
KIND_WORDS = re.compile(r"is_kvstore|kvstore_spec|kvcommit|objectstore|ObjectStore|TensorStore|PosixSink|"
                        r"DirectoryTarget|\bkv\b|\bkv_|\.kv\b")
# tools/ and cli/ are checked by identifier, not by text: their help and messages may name the
# stores a user passes (a TensorStore spec), and `kvstore_spec` is the public argument's name.
KIND_NAMES = re.compile(r"is_kvstore|kvcommit|objectstore|ObjectStore|TensorStore|PosixSink|DirectoryTarget|"
                        r"^kv$|^kv_|_kv$|_kv_")
TARGET_FOLDERS = ("safe_ckpt.targets.directory", "safe_ckpt.targets.objectstore")
KIND_ALLOWED: dict[tuple[str, str], str] = {
    ("safe_ckpt/cli/commands.py", "_kv_target"): "the earlier name of `_location`, kept for its callers",
    ("safe_ckpt/tools/copy.py", "safe_ckpt.targets.directory.copying"): "`_LocalSource`, the name a test patches",
    ("safe_ckpt/tools/copy.py", "safe_ckpt.targets.directory.copying.LocalSource"): "the same import",
}
NAME_LITERALS = re.compile(r"^(\.metadata|metadata\.json|common\.pt|safe_ckpt_manifest\.json|integrity\.json|"
                           r"latest_checkpointed_iteration\.txt|\.safe_ckpt-.*|.*\.distcp.*|\^?iter_.*)$")


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else parts[1] if len(parts) == 2 else ""


def imports_of(path: pathlib.Path, module: str, is_pkg: bool):
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            yield node.lineno, src
            for a in node.names:
                yield node.lineno, f"{src}.{a.name}"


def kind_names(path: pathlib.Path, module: str, is_pkg: bool) -> list[str]:
    """Identifiers and imports in a tools/ or cli/ module that name a kind of target."""
    if (str(path), "*") in KIND_ALLOWED:
        return []
    found = []
    for lineno, name in imports_of(path, module, is_pkg):
        if name.startswith(TARGET_FOLDERS) and (str(path), name) not in KIND_ALLOWED:
            found.append(f"{path}:{lineno}: imports one target's own module: {name}")
    for node in ast.walk(ast.parse(path.read_text())):
        ident = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                 else node.arg if isinstance(node, ast.arg)
                 else node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
        if ident and KIND_NAMES.search(ident) and (str(path), ident) not in KIND_ALLOWED:
            found.append(f"{path}:{node.lineno}: names a kind of target: {ident}")
    return sorted(set(found))


def main() -> int:
    findings = []
    for path in sorted(pathlib.Path(PACKAGE).rglob("*.py")):
        parts = list(path.with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_pkg else parts)
        here = folder_of(module) if len(parts) > 2 or not is_pkg else ""
        lines = path.read_text().count("\n")
        if lines > MAX_LINES and str(path) not in ALLOWED_OVER:
            findings.append(f"{path}: {lines} lines (over {MAX_LINES})")
        for lineno, name in imports_of(path, module, is_pkg):
            top = name.split(".")[0]
            if top in OUTSIDE:
                findings.append(f"{path}:{lineno}: imports {name} (the runtime package imports no lab, tests or benchmarks)")
            if top != PACKAGE or name.count(".") < 1:
                continue
            there = name.split(".")[1]
            if there in LATER.get(here, ()):
                findings.append(f"{path}:{lineno}: {here}/ imports {name} (later in the flow)")
            if there in EDGES and here not in EDGES | ENTRY_POINTS:
                findings.append(f"{path}:{lineno}: {here or module}/ imports the edge {name}")
        if here in ("saving", "plan"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if KIND_WORDS.search(code):
                    findings.append(f"{path}:{i}: names a kind of target: {line.strip()[:80]}")
        if here in ("tools", "cli"):
            findings += kind_names(path, module, is_pkg)
        if path.name != "names.py":
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME_LITERALS.match(node.value):
                    findings.append(f"{path}:{node.lineno}: on-disk name {node.value!r} outside names.py")
    for f in findings:
        print(f)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
