"""Rewrite imports after `git mv` of Python modules (run from the repository root).

Usage: python scripts/move_modules.py MOVES.txt [ROOT ...]
MOVES.txt: one "old.dotted.module new.dotted.module" per line (# comments allowed; "m m package"
marks a module whose file became its package's __init__.py, e.g. saving.py -> saving/); run it
AFTER the `git mv`s, once per step. ROOTs default to safe_ckpt safe_ckpt_lab tests benchmarks
scripts docs README.md. What it rewrites, in every file under the ROOTs:
  - relative imports (`from ..commit import x`, `from . import commit`) in .py files: resolved
    against the file's OLD module name, mapped, and re-emitted relative to its NEW one
    (absolute where the two no longer share a top package);
  - `from PKG import name` where PKG.name is a moved module: `from NEWPKG import newname as name`
    (the local name is kept, so monkeypatch targets like `commit.os` keep working);
  - every other dotted occurrence of an old module name, in code, strings, comments, shell
    scripts and Markdown (`safe_ckpt.bench` -> `safe_ckpt_lab.bench`), longest name first.
It never touches a name that only starts like a moved one (`safe_ckpt.commit_files` is not
`safe_ckpt.commit`). Prints every file it changed.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

DEFAULT_ROOTS = ["safe_ckpt", "safe_ckpt_lab", "tests", "benchmarks", "scripts", "docs", "README.md"]
EXCLUDED = ("benchmarks/results/",)  # records of past runs keep the names they were written with
TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".txt", ".cfg", ".ini", ""}


BECAME_PACKAGE: set[str] = set()  # modules whose file became their package's __init__.py


def load(path: str) -> dict[str, str]:
    """``old new`` per line; ``old old package`` for a module whose file became a package."""
    out = {}
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if line:
            old, new, *flag = line.split()
            if flag == ["package"]:
                BECAME_PACKAGE.add(new)
            if old != new:
                out[old] = new
    return out


def remap(name: str, mapping: dict[str, str]) -> str:
    best = max((o for o in mapping if name == o or name.startswith(o + ".")), key=len, default=None)
    return name if best is None else mapping[best] + name[len(best):]


def unmap(name: str, mapping: dict[str, str]) -> str:
    reverse = {v: k for k, v in mapping.items()}
    return remap(name, reverse)


def module_of(path: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def package_of(module: str, is_pkg: bool) -> str:
    return module if is_pkg else module.rpartition(".")[0]


def absolute(level: int, module: str | None, package: str) -> str:
    base = package.split(".")
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def relative(target: str, package: str) -> str | None:
    t, p = target.split("."), package.split(".")
    if t[0] != p[0]:
        return None
    i = 0
    while i < min(len(t), len(p)) and t[i] == p[i]:
        i += 1
    return "." * (len(p) - i + 1) + ".".join(t[i:])


def is_module(name: str, mapping: dict[str, str], modules: set[str]) -> bool:
    """Whether ``name`` (an old dotted name) is a module or package that moved or lives under one."""
    return name in mapping or remap(name, mapping) in modules or any(o.startswith(name + ".") for o in mapping)


def render(module: str, names: list[tuple[str, str | None]], rel_package: str | None, indent: str) -> str:
    spec = relative(module, rel_package) if rel_package is not None else None
    frm = spec if spec is not None else module
    items = ", ".join(n if a is None or a == n else f"{n} as {a}" for n, a in names)
    return f"{indent}from {frm} import {items}"


def rewrite_python(text: str, new_module: str, is_pkg: bool, mapping: dict[str, str], modules: set[str]) -> str:
    old_module = unmap(new_module, mapping)
    old_pkg = package_of(old_module, is_pkg and new_module not in BECAME_PACKAGE)
    new_pkg = package_of(new_module, is_pkg)
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    edits, spans = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        spans.update(range(node.lineno - 1, node.end_lineno))
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        if isinstance(node, ast.Import):
            names = [(remap(a.name, mapping), a.asname) for a in node.names]
            if any(n != a.name for (n, _), a in zip(names, node.names)):
                body = ", ".join(n if a is None else f"{n} as {a}" for n, a in names)
                edits.append((node.lineno, node.end_lineno, f"{indent}import {body}\n"))
            continue
        src = absolute(node.level, node.module, old_pkg) if node.level else node.module
        groups: list[tuple[str, list]] = []  # (module, [(name, alias)])
        changed = bool(node.level) and (old_pkg != new_pkg or remap(src, mapping) != src)
        for alias in node.names:
            full = f"{src}.{alias.name}"
            if alias.name != "*" and is_module(full, mapping, modules) and remap(full, mapping) != full:
                parent, _, leaf = remap(full, mapping).rpartition(".")
                entry = (leaf, alias.asname or alias.name)
                changed = True
            else:
                parent, entry = remap(src, mapping), (alias.name, alias.asname)
                changed = changed or parent != src
            if groups and groups[-1][0] == parent:
                groups[-1][1].append(entry)
            else:
                groups.append((parent, [entry]))
        if changed:
            keep_relative = new_pkg if node.level else None
            if len(groups) == 1 and [(a.name, a.asname or a.name) for a in node.names] == \
                    [(n, a or n) for n, a in groups[0][1]] and \
                    (relative(groups[0][0], new_pkg) if node.level else groups[0][0]) == \
                    ("." * node.level + (node.module or "") if node.level else node.module):
                continue  # the same text resolves to the same module from the new place: keep it as written
            comment = _trailing_comment(lines[node.lineno - 1:node.end_lineno])
            body = "\n".join(render(m, names, keep_relative, indent) for m, names in groups)
            edits.append((node.lineno, node.end_lineno, body + (f"  {comment}" if comment else "") + "\n"))
    # every line outside an import statement: dotted and path names
    lines = [line if i in spans else rewrite_dotted(line, mapping) for i, line in enumerate(lines)]
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = [new]
    return "".join(lines)


def _trailing_comment(source_lines: list[str]) -> str:
    """The first `# ...` comment on an import statement's lines (a `noqa` must survive the rewrite)."""
    for line in source_lines:
        code, sep, comment = line.partition("#")
        if sep and code.count('"') % 2 == 0 and code.count("'") % 2 == 0:
            return "#" + comment.rstrip("\n").rstrip()
    return ""


def rewrite_dotted(text: str, mapping: dict[str, str]) -> str:
    # Logger names stay: the library logs under "safe_ckpt" whatever module writes the line.
    kept = {i: line for i, line in enumerate(text.splitlines(keepends=True)) if "getLogger(" in line}
    text = _rewrite_dotted(text, mapping)
    if kept:
        lines = text.splitlines(keepends=True)
        for i, line in kept.items():
            lines[i] = line
        text = "".join(lines)
    return text


def _rewrite_dotted(text: str, mapping: dict[str, str]) -> str:
    """One pass, longest name first, so a name is never rewritten twice."""
    olds = sorted(mapping, key=len, reverse=True)
    dotted = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, olds)) + r")(?!\w)")
    text = dotted.sub(lambda m: mapping[m.group(1)], text)
    # path form in prose and shell: safe_ckpt/bench/ -> safe_ckpt_lab/bench/, safe_ckpt/commit.py
    paths = {o.replace(".", "/"): mapping[o].replace(".", "/") for o in olds}
    slashed = re.compile(r"(?<![\w/])(" + "|".join(map(re.escape, paths)) + r")(?=\.py\b|/)")
    return slashed.sub(lambda m: paths[m.group(1)], text)


def main(argv: list[str]) -> int:
    mapping = load(argv[1])
    roots = [pathlib.Path(r) for r in (argv[2:] or DEFAULT_ROOTS)]
    files = [f for r in roots if r.exists() for f in ([r] if r.is_file() else sorted(r.rglob("*")))
             if f.is_file() and f.suffix in TEXT_SUFFIXES and "__pycache__" not in f.parts
             and not str(f).startswith(EXCLUDED)]
    modules = {module_of(f)[0] for f in files if f.suffix == ".py"}
    for f in files:
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        out = text
        if f.suffix == ".py":
            module, is_pkg = module_of(f)
            out = rewrite_python(out, module, is_pkg, mapping, modules)
        else:
            out = rewrite_dotted(out, mapping)
        if out != text:
            f.write_text(out)
            print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
