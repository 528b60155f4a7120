"""The GPU's figures, in one place: every floor, plan and cost model reads them here.

A floor is bytes ÷ HBM bandwidth (decode) or FLOPs ÷ matmul peak (prefill); a PCIe floor is
host bytes ÷ the pinned host→device rate. The figures are measured ceilings, not datasheet
numbers (DESIGN.md, "Measured ceilings"): a device-to-device copy counting read + write.

`gpu_figures(device)` identifies the GPU by name (H100, H200); any other CUDA device is
measured once with a device copy (its matmul peak and PCIe rate then stay unknown: None).
The CPU has no floors: `gpu_figures("cpu")` is None, and reports print "n/a".

The cost policy's overhead (µs per sparse layer-step, sparse_policy.py) depends on the GPU's
launch and kernel latencies as much as on its bandwidth, so each known GPU carries its own fit
(benchmarks/sparse_policy_fit.py); an unknown GPU takes the H100's, the conservative one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class GpuFigures:
    """Measured ceilings of one GPU model (None: not known for it)."""

    name: str
    hbm_bytes_per_s: float  # device copy, read + write counted
    matmul_flops: float | None  # bf16 dense matmul
    pcie_bytes_per_s: float | None  # pinned host -> device, contiguous
    policy_overhead_us: float  # cost policy: µs of one sparse layer-step at batch 1
    policy_overhead_growth_us: float  # µs more per further request selecting in the same step
    source: str  # where the figures come from: "table" or "measured"

    @property
    def hbm_tb_s(self) -> float:
        return self.hbm_bytes_per_s / 1e12

    def floor_ms(self, nbytes: float) -> float:
        """Milliseconds to read `nbytes` from HBM at this GPU's ceiling."""
        return nbytes / self.hbm_bytes_per_s * 1e3


# H100 80GB HBM3 (SXM): DESIGN.md's table; the policy's fit: benchmarks/results/sparse_policy_fit.json
H100 = GpuFigures("H100", 3.0e12, 790e12, 55e9, 27.9, 1.1, "table")
# H200 141GB HBM3e: a device copy measures 4.28 TB/s (DESIGN.md); same chip as the H100, so the
# same matmul peak and PCIe gen5 link. The policy's fit: benchmarks/results/sparse_policy_fit_h200.json
# (stop 54: refitted on true sparse steps, decode_layer.py with sparse_policy "always")
H200 = GpuFigures("H200", 4.3e12, 790e12, 55e9, 21.6, 0.81, "table")
KNOWN: tuple[GpuFigures, ...] = (H200, H100)  # matched by name, in this order
DEFAULT = H100  # a report that must show a figure without a device (docs, the CPU's "n/a")


def figures_for_name(device_name: str) -> GpuFigures | None:
    """The table's figures for a CUDA device name ("NVIDIA H200", "NVIDIA H100 80GB HBM3"), or None."""
    upper = device_name.upper()
    return next((f for f in KNOWN if f.name in upper), None)


def gpu_figures(device: str | torch.device | None = None) -> GpuFigures | None:
    """The figures of `device` (default: the current CUDA device); None on the CPU."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_figures(index)


@functools.cache
def _cuda_figures(index: int) -> GpuFigures:
    name = torch.cuda.get_device_name(index)
    known = figures_for_name(name)
    if known is not None:
        return known
    return replace(DEFAULT, name=name, hbm_bytes_per_s=measure_copy_bandwidth(index), matmul_flops=None,
                   pcie_bytes_per_s=None, source="measured")


def measure_copy_bandwidth(index: int, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), the median of
    `repeats` after a warm copy: the HBM ceiling floors are stated against."""
    device = torch.device("cuda", index)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * src.numel() / times[len(times) // 2]


def hbm_bytes_per_s(device: str | torch.device | None = None) -> float:
    """The HBM ceiling of `device`, or the default GPU's where there is none (the CPU): for
    cost models that need a figure on any device."""
    return (gpu_figures(device) or DEFAULT).hbm_bytes_per_s


def describe(figures: GpuFigures | None) -> str:
    """One line for reports: which figures the floors use."""
    if figures is None:
        return "floors: n/a on the CPU"
    return (f"floors: {figures.name} at {figures.hbm_tb_s:.2f} TB/s HBM"
            + (f", {figures.matmul_flops / 1e12:.0f} TFLOP/s bf16" if figures.matmul_flops else "")
            + f" ({figures.source})")
