"""The device model: GPU memory, reserve, host memory, compute speed and the CPU-GPU link.

Plain frozen values; sizes are integers (bytes), bandwidths bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lmscli.errors import InputError
from lmscli.units import parse_bandwidth, parse_size

# Per-direction bandwidths of CPU-GPU links, bytes per second.
LINKS = {
    "pcie3": 16e9,
    "pcie4": 32e9,
    "pcie5": 64e9,
    "nvlink2": 150e9,
    "nvlink-c2c": 450e9,
}

# The stand-in GPU's "link": a tensor sent between two TensorFlow server processes on this machine
# over gRPC on the loopback (serialized, copied, parsed). A conservative figure for planning swaps
# that ``lms verify --gpu-mem`` proves (``--stand-in``).
STAND_IN_LINK = "1GB/s"

# name -> (gpu memory, fp32 FLOP/s, device memory bandwidth B/s, default link)
PRESETS = {
    "v100-16g": (16 << 30, 15.7e12, 900e9, "nvlink2"),
    "v100-32g": (32 << 30, 15.7e12, 900e9, "nvlink2"),
    "p100-16g": (16 << 30, 10.6e12, 732e9, "pcie3"),
    "a100-40g": (40 << 30, 19.5e12, 1555e9, "pcie4"),
    "a100-80g": (80 << 30, 19.5e12, 2039e9, "pcie4"),
    "h100-80g": (80 << 30, 51e12, 3350e9, "pcie5"),
}

DEFAULT_RESERVE = 0.10
DEFAULT_HOST_MEM = 64 << 30


NO_BUDGET = 1 << 50  # "no limit": manual TFLMS parameters are applied without a budget to meet


@dataclass(frozen=True)
class Device:
    """What the planner plans for. ``budget`` is what tensors may use: gpu_mem x (1 - reserve)."""

    gpu_mem: int
    reserve: float = DEFAULT_RESERVE
    host_mem: int = DEFAULT_HOST_MEM
    link_name: str = "nvlink2"
    link_bandwidth: float = LINKS["nvlink2"]
    flops: float = 15.7e12
    mem_bandwidth: float = 900e9
    name: str = "custom"

    @property
    def budget(self) -> int:
        return int(self.gpu_mem * (1.0 - self.reserve))

    def with_link(self, link: str) -> "Device":
        name, bandwidth = resolve_link(link)
        return replace(self, link_name=name, link_bandwidth=bandwidth)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "gpu_mem_bytes": self.gpu_mem,
            "reserve": self.reserve,
            "budget_bytes": self.budget,
            "host_mem_bytes": self.host_mem,
            "link": self.link_name,
            "link_bytes_per_second": self.link_bandwidth,
            "flops": self.flops,
            "mem_bytes_per_second": self.mem_bandwidth,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Device":
        return cls(
            gpu_mem=int(data["gpu_mem_bytes"]),
            reserve=float(data.get("reserve", DEFAULT_RESERVE)),
            host_mem=int(data.get("host_mem_bytes", DEFAULT_HOST_MEM)),
            link_name=str(data.get("link", "nvlink2")),
            link_bandwidth=float(data.get("link_bytes_per_second", LINKS["nvlink2"])),
            flops=float(data.get("flops", 15.7e12)),
            mem_bandwidth=float(data.get("mem_bytes_per_second", 900e9)),
            name=str(data.get("name", "custom")),
        )


def resolve_link(link: str) -> tuple[str, float]:
    key = link.strip().lower()
    if key in LINKS:
        return key, LINKS[key]
    try:
        return link.strip(), parse_bandwidth(link)
    except InputError:
        raise InputError(
            f"unknown link {link!r} (use one of {', '.join(sorted(LINKS))} or a figure like 25GB/s)"
        ) from None


def gpu_mem_from_text(text: str | int | None, peak_bytes: int | None = None) -> int | None:
    """``16GiB`` -> bytes; ``50%`` -> half of ``peak_bytes`` (the no-swap peak)."""
    if text is None:
        return None
    if isinstance(text, str) and text.strip().endswith("%"):
        try:
            share = float(text.strip()[:-1]) / 100.0
        except ValueError:
            raise InputError(f"not a percentage: {text!r}") from None
        if not 0 < share <= 10:
            raise InputError(f"--gpu-mem percentage must be in (0, 1000]: {text!r}")
        if peak_bytes is None:
            raise InputError("a --gpu-mem percentage needs the graph's peak")
        return int(peak_bytes * share)
    return parse_size(text)


def make_device(
    gpu_mem: str | int | None = None,
    preset: str | None = None,
    reserve: float | None = None,
    host_mem: str | int | None = None,
    link: str | None = None,
) -> Device:
    """Build a Device from user-level values (strings are parsed here, at the edge)."""
    if preset is not None:
        key = preset.lower()
        if key not in PRESETS:
            raise InputError(f"unknown device {preset!r} (choose from {', '.join(PRESETS)})")
        mem, flops, bw, default_link = PRESETS[key]
        device = Device(gpu_mem=mem, flops=flops, mem_bandwidth=bw, name=key,
                        link_name=default_link, link_bandwidth=LINKS[default_link])
    else:
        device = Device(gpu_mem=1)
    if gpu_mem is not None:
        device = replace(device, gpu_mem=parse_size(gpu_mem))
    elif preset is None:
        raise InputError("give the GPU memory with --gpu-mem SIZE (e.g. 16GiB) or a --device preset")
    if device.gpu_mem <= 0:
        raise InputError("--gpu-mem must be positive")
    if reserve is not None:
        if not 0.0 <= reserve < 1.0:
            raise InputError(f"--reserve must be in [0, 1), got {reserve}")
        device = replace(device, reserve=float(reserve))
    if host_mem is not None:
        device = replace(device, host_mem=parse_size(host_mem))
    if link is not None:
        device = device.with_link(link)
    return device
