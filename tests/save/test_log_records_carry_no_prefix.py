"""The library's log records carry no "safe_ckpt: " prefix of their own: the logger's name says it,
and a script's `logging.basicConfig(level=INFO)` would print it twice (`INFO:safe_ckpt:safe_ckpt: ...`).
Read from the source, so the warning paths a test cannot easily reach are covered too."""

import ast
import os

from tests.helpers.paths import REPO as ROOT

LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
NOT_YET: set = set()


def _message(call: ast.Call):
    args = call.args[1:] if call.func.attr == "log" else call.args
    if not args:
        return None
    first = args[0]
    if isinstance(first, ast.JoinedStr) and first.values and isinstance(first.values[0], ast.Constant):
        first = first.values[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _prefixed(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LEVELS
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("log", "logger")):
            message = _message(node)
            if message is not None and message.startswith("safe_ckpt:"):
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {message[:50]!r}")
    return out


def test_no_log_record_of_the_library_repeats_the_logger_name():
    found = []
    for directory, _, names in os.walk(os.path.join(ROOT, "safe_ckpt")):
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(".py") and os.path.relpath(path, ROOT) not in NOT_YET:
                found += _prefixed(path)
    assert not found, "\n".join(found)
