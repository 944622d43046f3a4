"""A copy of the installed Megatron whose DDP buffers behave as slime's Megatron patch makes them.

slime (THUDM/slime 624b824a) applies `docker/patch/latest/megatron.patch` to its pinned Megatron-LM
1dcf0dafa884. Three of its files decide where the DDP buffers live:
- `megatron/training/training.py` (`get_model`): passes `args.disable_grad_buffers_cpu_backup` and
  `args.disable_param_buffers_cpu_backup` (slime's `parse_args` sets both with `--offload-train`)
  to every `DistributedDataParallel` it builds;
- `megatron/core/distributed/distributed_data_parallel.py`: takes them and hands them to each
  `_ParamAndGradBuffer`;
- `megatron/core/distributed/param_and_grad_buffer.py`: the param flag counts only with the
  distributed optimizer; `nccl_ub` refuses them; the bf16 `param_data` is allocated inside
  `torch_memory_saver.region(tag="param_buffer", enable_cpu_backup=False)` and `grad_data` inside
  `region(tag="grad_buffer", enable_cpu_backup=False)` (an MXFP8 shared buffer in the param one
  when that flag is on, else in the grad one).
A fourth hunk keeps torch_memory_saver in the hook mode slime starts it in (preload):
`megatron/core/inference/contexts/dynamic_context.py` no longer sets `torch_memory_saver.hook_mode =
"torch"` at import (and counts the saver as absent). megatron-core 0.19.2's `megatron/training/
training.py` sets it at import too (1dcf0dafa884's does not import the saver): the port treats that
line as slime's hunk treats the other.

This script copies the installed `megatron` package (megatron.core and, where the distribution
ships it, megatron.training) to DEST and makes those changes there, leaving the installation as it
is; put DEST first on PYTHONPATH. Two ways, reported on the last line:
- `--slime-patch FILE` (slime's megatron.patch): the hunks of those three files, applied with
  `patch -p1` if they apply cleanly (slime's pinned Megatron-LM);
- otherwise (megatron-core 0.19.2, where they do not apply: the DDP constructor gained
  `full_param_layout`, `get_model` moved the wrapping into `wrap_model_chunks_with_ddp`, the buffer
  allocation gained NVFP4 packing) the same changes made at the same places of this version's code,
  each anchored on a line that must occur exactly once; any anchor missing stops the script.

Usage: python scripts/slime_megatron_patch.py DEST [--slime-patch FILE] [--force]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

FILES = ("megatron/core/distributed/distributed_data_parallel.py",
         "megatron/core/distributed/param_and_grad_buffer.py",
         "megatron/training/training.py",
         "megatron/core/inference/contexts/dynamic_context.py")
TORCH_HOOK_MODE = ('    torch_memory_saver.hook_mode = "torch"\n    HAVE_TORCH_MEMORY_SAVER = True\n',
                   '    # torch_memory_saver.hook_mode = "torch"\n    HAVE_TORCH_MEMORY_SAVER = False\n')
FLAGS = ("disable_grad_buffers_cpu_backup", "disable_param_buffers_cpu_backup")


class AnchorError(RuntimeError):
    pass


def installed_megatron() -> str:
    """The directory holding the installed `megatron` package (without importing megatron.core)."""
    spec = importlib.util.find_spec("megatron")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if os.path.isfile(os.path.join(location, "core", "distributed", "param_and_grad_buffer.py")):
            return location
    raise SystemExit(f"no megatron.core found on the path (searched {locations})")


def _once(text: str, anchor: str, where: str) -> int:
    count = text.count(anchor)
    if count != 1:
        raise AnchorError(f"{where}: expected this line once, found it {count} times:\n{anchor}")
    return text.index(anchor)


def insert_after(text: str, anchor: str, addition: str, where: str) -> str:
    at = _once(text, anchor, where) + len(anchor)
    return text[:at] + addition + text[at:]


def wrap_in(text: str, block: str, context: str, where: str) -> str:
    """Put ``block`` (whole lines) inside `with <context>:` at its own indentation."""
    at = _once(text, block, where)
    indent = block[:len(block) - len(block.lstrip(" "))]
    body = "".join(("    " + line) if line.strip() else line for line in block.splitlines(keepends=True))
    return text[:at] + f"{indent}with {context}:\n" + body + text[at + len(block):]


def port_ddp(text: str) -> str:
    where = FILES[0]
    text = insert_after(text, "        full_param_layout: Optional[FullParamLayout] = None,\n",
                        "".join(f"        {f}: bool = False,\n" for f in FLAGS), where)
    return insert_after(text, "                param_layout=param_layout,\n",
                        "".join(f"                {f}={f},\n" for f in FLAGS), where)


def port_buffer(text: str) -> str:
    where = FILES[1]
    text = insert_after(text, "        param_layout: Optional['PerBufferParamLayout'] = None,\n",
                        "".join(f"        {f}: bool = False,\n" for f in FLAGS), where)
    text = insert_after(text, "        self.nccl_ub = nccl_ub\n",
                        "        disable_param_buffers_cpu_backup = (\n"
                        "            disable_param_buffers_cpu_backup and self.ddp_config.use_distributed_optimizer\n"
                        "        )\n", where)
    text = insert_after(
        text, "            # If nccl_ub is True, use nccl_allocator to allocate memory for param_data/grad_data.\n",
        "".join(f"            assert not {f}, \"{f} is not supported with nccl_ub=True\"\n" for f in FLAGS), where)
    text = insert_after(
        text, "            # If nccl_ub is False, mem_alloc_context is nullcontext.\n            mem_alloc_context = nullcontext\n",
        "\n"
        "        def _make_no_backup_context(tag, disable, flag_name):\n"
        "            if disable:\n"
        "                try:\n"
        "                    from torch_memory_saver import torch_memory_saver\n"
        "                except ImportError as e:\n"
        "                    raise ImportError(f\"{flag_name}=True requires torch_memory_saver\") from e\n"
        "                return functools.partial(torch_memory_saver.region, tag=tag, enable_cpu_backup=False)\n"
        "            return nullcontext\n"
        "\n"
        "        grad_mem_alloc_context = _make_no_backup_context(\n"
        "            \"grad_buffer\", disable_grad_buffers_cpu_backup, \"disable_grad_buffers_cpu_backup\"\n"
        "        )\n"
        "        param_mem_alloc_context = _make_no_backup_context(\n"
        "            \"param_buffer\", disable_param_buffers_cpu_backup, \"disable_param_buffers_cpu_backup\"\n"
        "        )\n", where)
    text = wrap_in(text,
                   "                self.shared_buffer = torch.zeros(\n"
                   "                    self.numel,\n"
                   "                    dtype=self.grad_dtype,\n"
                   "                    device=torch.cuda.current_device(),\n"
                   "                    requires_grad=False,\n"
                   "                )\n",
                   "(param_mem_alloc_context if disable_param_buffers_cpu_backup else grad_mem_alloc_context)()",
                   where)
    text = wrap_in(text,
                   "                    self.param_data = torch.zeros(\n"
                   "                        numel,\n"
                   "                        dtype=self.param_dtype,\n"
                   "                        device=torch.cuda.current_device(),\n"
                   "                        requires_grad=False,\n"
                   "                    )\n",
                   "param_mem_alloc_context()", where)
    return wrap_in(text,
                   "                self.grad_data = torch.zeros(\n"
                   "                    self.numel,\n"
                   "                    dtype=self.grad_dtype,\n"
                   "                    device=torch.cuda.current_device(),\n"
                   "                    requires_grad=False,\n"
                   "                )\n",
                   "grad_mem_alloc_context()", where)


def keep_preload_mode(text: str, where: str) -> str:
    _once(text, TORCH_HOOK_MODE[0], where)
    return text.replace(*TORCH_HOOK_MODE)


def port_training(text: str) -> str:
    if TORCH_HOOK_MODE[0] in text:
        text = keep_preload_mode(text, FILES[2])
    return insert_after(
        text, "        if layout is not None:\n            chunk_kwargs[\"full_param_layout\"] = layout\n",
        "        if DP is DDP:  # slime's get_model: the buffers' torch_memory_saver regions\n"
        + "".join(f"            chunk_kwargs[\"{f}\"] = getattr(get_args(), \"{f}\", False)\n" for f in FLAGS),
        FILES[2])


PORTS = dict(zip(FILES, (port_ddp, port_buffer, port_training, lambda text: keep_preload_mode(text, FILES[3]))))


def slime_hunks(patch_file: str) -> str:
    """The parts of slime's megatron.patch that change the three files."""
    text = open(patch_file).read()
    parts = re.split(r"(?=^diff --git )", text, flags=re.M)
    return "".join(p for p in parts if p.startswith("diff --git") and any(f in p.split("\n", 1)[0] for f in FILES))


def apply_slime_patch(dest: str, patch_file: str) -> bool:
    hunks = slime_hunks(patch_file)
    if hunks.count("diff --git") != len(FILES):
        return False
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as f:
        f.write(hunks)
    try:
        dry = subprocess.run(["patch", "-p1", "--dry-run", "-f", "-i", f.name], cwd=dest, capture_output=True, text=True)
        if dry.returncode != 0:
            return False
        subprocess.run(["patch", "-p1", "-f", "-s", "-i", f.name], cwd=dest, check=True)
        return True
    finally:
        os.unlink(f.name)


def make(dest: str, slime_patch: str | None = None, force: bool = False) -> str:
    """Copy the installed megatron to DEST/megatron and change it; returns how."""
    source = installed_megatron()
    target = os.path.join(dest, "megatron")
    if os.path.exists(target):
        if not force and not os.path.isfile(os.path.join(dest, ".slime_megatron_patch")):
            raise SystemExit(f"refusing to replace {target}: not made by this script (pass --force)")
        shutil.rmtree(target)
    os.makedirs(dest, exist_ok=True)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    missing = [f for f in FILES if not os.path.isfile(os.path.join(dest, f))]
    if missing:
        raise SystemExit(f"the installed megatron lacks {missing} (megatron.training is needed: megatron-core >= 0.19 "
                         "ships it, or Megatron-LM's tree)")
    how = None
    if slime_patch and apply_slime_patch(dest, slime_patch):
        how = f"slime's hunks from {slime_patch}"
    else:
        for name, port in PORTS.items():
            path = os.path.join(dest, name)
            text = open(path).read()
            if all(f in text for f in FLAGS) or TORCH_HOOK_MODE[1] in text:
                raise SystemExit(f"{name} already carries slime's flags: is the source already patched?")
            open(path, "w").write(port(text))
        how = "the port of slime's hunks to this version" + (" (slime's own did not apply)" if slime_patch else "")
    for name in FILES:  # it must still compile
        compile(open(os.path.join(dest, name)).read(), name, "exec")
    with open(os.path.join(dest, ".slime_megatron_patch"), "w") as f:
        f.write(how + "\n")
    return how


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest")
    parser.add_argument("--slime-patch", default=None, help="slime's docker/patch/latest/megatron.patch")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    try:
        import importlib.metadata as md

        version = md.version("megatron-core")
    except Exception:
        version = "unknown"
    try:
        how = make(args.dest, args.slime_patch, args.force)
    except AnchorError as exc:
        raise SystemExit(f"slime megatron patch: cannot port to megatron-core {version}: {exc}")
    print(f"slime megatron patch: {how}, applied to a copy of megatron-core {version} in {args.dest}")


if __name__ == "__main__":
    sys.exit(main())
