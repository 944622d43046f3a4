"""The command line's one way into the lab (`safe_ckpt_lab`: the demo and the benchmark harness).

One job: import a module of the lab by name for `safe-ckpt demo` and `safe-ckpt bench`: where
it is importable (installed beside the library, or on the path), else from the repository
this package was installed from in place (a clone, `pip install -e .`), else refuse with one
line saying where the lab is. Must not: import the lab at module level (the library runs
without it; `scripts/check_layout.py` keeps every other module of `safe_ckpt` off it).
"""

from __future__ import annotations

import importlib
import pathlib
import sys

LAB = "safe_ckpt_lab"


class LabMissing(ValueError):
    """The lab is not part of this installation (the command line exits 2)."""


def clone_root() -> pathlib.Path:
    """The directory holding this `safe_ckpt` package: a clone's root where it was installed in place."""
    return pathlib.Path(__file__).resolve().parent.parent.parent


def lab_module(module: str, command: str):
    """``safe_ckpt_lab.<module>`` for ``safe-ckpt <command>``. A lab that is there but misses one of
    its own dependencies raises that error as it is (it names what to install)."""
    name = f"{LAB}.{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if not _is_the_lab(exc.name, name):
            raise
    root = clone_root()
    if (root / LAB / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.append(str(root))
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not _is_the_lab(exc.name, name):
                raise
    raise LabMissing(f"`safe-ckpt {command}` runs the lab kept in safe_ckpt's source repository ({LAB}/), "
                     "which this installation does not include; run it from a clone (pip install -e .)")


def _is_the_lab(missing: str | None, name: str) -> bool:
    return missing is not None and (missing == LAB or name == missing or name.startswith(missing + "."))
