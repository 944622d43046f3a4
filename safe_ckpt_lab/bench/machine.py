"""What the bench ran on: the host, its software, and the filesystem of each target.

One job: describe the machine for a results file (``machine()``: host, CPU, cores, memory,
Python, torch, megatron-core, safe_ckpt, GPUs, date, and the one line a report prints) and
name a path's filesystem (``fs_type``, the longest mount point in /proc/mounts that holds it).
Must not: measure anything, or be imported by the library.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket

import torch


def machine() -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024
    except (OSError, StopIteration):
        pass
    import megatron.core

    import safe_ckpt

    info = {
        "host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "mem_total_bytes": mem,
        "python": platform.python_version(), "torch": torch.__version__,
        "megatron_core": getattr(megatron.core, "__version__", "?"), "safe_ckpt": safe_ckpt.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "date": datetime.date.today().isoformat(),
    }
    info["machine_line"] = (f"{info['cores']} cores ({cpu}), {mem / 2**30:.0f} GiB RAM, "
                            f"GPUs: {', '.join(info['gpus']) or 'none'}; torch {info['torch']}, "
                            f"megatron-core {info['megatron_core']}, Python {info['python']}")
    return info


def fs_type(path: str, mounts: str = "/proc/mounts") -> str:
    best, fstype = "", "?"
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                point = parts[1]
                # a mount point holds the path itself and what lies below it, not /tmpfoo for /tmp
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(best):
                    best, fstype = point, parts[2]
    except OSError:
        pass
    return fstype
