"""Where a benchmark ran: hardware and software versions, for the report's ``config``."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def environment(device: torch.device) -> dict:
    import transformers

    from flashtree.version import __version__

    info = {
        "device": str(device),
        "device_name": device_name(device),
        "cpu": cpu_name(),
        "cpus_usable": usable_cpus(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "flashtree": __version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(cuda=torch.version.cuda, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return info
