"""The hardware and software fingerprint a study is keyed by, so results never silently mix
devices, drivers or torch versions."""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import tuner
from tuner.devices import DeviceInfo, _cpu_name, cpu_model_id, describe, resolve_family


def _nvidia_driver() -> str | None:
    # torch does not expose the driver version; the kernel module reports it without NVML.
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for token in text.split():
        if token[:1].isdigit() and token.count(".") >= 1:
            return token
    return None


def fingerprint(family: str, info: DeviceInfo | None = None) -> dict[str, Any]:
    """What a measurement depends on besides the recipe: device model and count, versions. `info`
    is the family's description when it is not this process's own (a Ray node's, whose device
    count is what Ray lets its trials use).

    The host name is left out on purpose: identical nodes of a cluster share one study.
    """
    info = info or describe(family)
    fp: dict[str, Any] = {
        "family": family,
        "device": info.name,
        "device_count": info.count,
        "cpu": _cpu_name(),
        "cpu_model": cpu_model_id(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tuner": tuner.__version__,
    }
    if family == "cuda":
        fp["cuda"] = torch.version.cuda
        fp["driver"] = _nvidia_driver()
        fp["capability"] = info.extra.get("capability")
    if family == "npu":
        fp["torch_npu"] = info.extra.get("torch_npu")
    return fp


@dataclass(frozen=True)
class Described:
    """Where a study's trials run, as the study sees it: the family a recipe's `hardware.device`
    means there, what its devices offer, and the fingerprint the study is keyed by. One executor's
    answer (`Executor.describe`): this machine's for the local one, the nodes' own for Ray."""

    family: str
    device: DeviceInfo
    fingerprint: dict[str, Any]


def described_here(requested: str) -> Described:
    """`Described` for this machine: `hardware.device` resolved and described here."""
    family = resolve_family(requested)
    info = describe(family)
    return Described(family, info, fingerprint(family, info))


def fingerprint_hash(fp: dict[str, Any]) -> str:
    """Short stable hash of a fingerprint (8 hex digits)."""
    blob = json.dumps(fp, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:8]
