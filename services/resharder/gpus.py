"""Known GPU types: memory and peak dense bf16 throughput, the two numbers a plan and a days estimate need."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuType:
    key: str  # what `flightdeck plan --gpu` takes
    name: str
    memory_gb: float  # per device, as the datasheet states it (GB)
    peak_tflops: float  # dense bf16 tensor-core TFLOP/s (no 2:4 sparsity); 0 for a slot we cannot rate

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12


# NVIDIA datasheets, dense bf16 (the "with sparsity" figures are twice these):
#   A100 SXM (40 GB and 80 GB): 312 TFLOP/s              (A100 datasheet, "BF16 Tensor Core 312 | 624*")
#   H100 SXM5 80 GB:            989 TFLOP/s              (H100 datasheet, "BF16 Tensor Core 1,979*" sparse)
#   H100 PCIe 80 GB:            756 TFLOP/s              (H100 datasheet, "BF16 Tensor Core 1,513*" sparse)
#   H200 SXM 141 GB:            989 TFLOP/s              (H200 datasheet: same compute as H100 SXM, more HBM3e)
KNOWN: tuple[GpuType, ...] = (
    GpuType("a100-40gb", "A100 40GB", 40.0, 312.0),
    GpuType("a100-80gb", "A100 80GB", 80.0, 312.0),
    GpuType("h100", "H100 SXM 80GB", 80.0, 989.0),
    GpuType("h100-pcie", "H100 PCIe 80GB", 80.0, 756.0),
    GpuType("h200", "H200 141GB", 141.0, 989.0),
)
BY_KEY: dict[str, GpuType] = {g.key: g for g in KNOWN}
ALIASES: dict[str, str] = {"h100-sxm": "h100", "h200-sxm": "h200", "a100-40": "a100-40gb", "a100-80": "a100-80gb"}


class UnknownGpu(ValueError):
    """A GPU name not in the table; the message lists the known ones."""


def lookup(name: str) -> GpuType:
    key = name.strip().lower()
    found = BY_KEY.get(ALIASES.get(key, key))
    if found is None:
        known = ", ".join(f"{g.key} ({g.name})" for g in KNOWN)
        raise UnknownGpu(f"unknown GPU {name!r}: choose one of {known}")
    return found


def match_device(device: str) -> GpuType | None:
    """The table entry for a device name as nvidia-smi reports it (e.g. "NVIDIA H100 80GB HBM3"), if any."""
    text = device.upper()
    if "H200" in text:
        return BY_KEY["h200"]
    if "H100" in text:
        return BY_KEY["h100-pcie" if "PCIE" in text else "h100"]
    if "A100" in text:
        return BY_KEY["a100-80gb" if "80GB" in text.replace(" ", "") else "a100-40gb"]
    return None


def slot(name: str, memory_gb: float) -> GpuType:
    """A device the table does not know (a CPU slot, an unrated GPU): memory only, no peak to rate it by."""
    return GpuType(name, name, memory_gb, 0.0)
