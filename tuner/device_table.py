"""Datasheet facts about accelerators: dense peak TFLOP/s for MFU, and a catalogue of common
devices (capability, memory) so rules and plans can describe a machine this one is not."""

from __future__ import annotations

from dataclasses import dataclass

# Dense peak TFLOP/s per device (no sparsity), by substring of the device name, most specific
# first. Sources: vendor datasheets. Used for MFU; unknown accelerators fall back to a measured
# matmul like the CPU does.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H800", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H20", {"fp32": 44.0, "tf32": 74.0, "bf16": 148.0, "fp16": 148.0}),
    ("GH200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("B200", {"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("A800", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("A10G", {"fp32": 31.2, "tf32": 70.0, "bf16": 140.0, "fp16": 140.0}),
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    ("L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    ("RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    ("V100", {"fp32": 15.7, "tf32": 15.7, "bf16": 15.7, "fp16": 125.0}),
    ("T4", {"fp32": 8.1, "tf32": 8.1, "bf16": 8.1, "fp16": 65.0}),
    # Ascend (torch_npu reports names such as "Ascend910B2").
    ("910B1", {"fp32": 94.0, "tf32": 94.0, "bf16": 378.0, "fp16": 378.0}),
    ("910B2", {"fp32": 94.0, "tf32": 94.0, "bf16": 353.0, "fp16": 353.0}),
    ("910B3", {"fp32": 75.0, "tf32": 75.0, "bf16": 313.0, "fp16": 313.0}),
    ("910B4", {"fp32": 70.0, "tf32": 70.0, "bf16": 280.0, "fp16": 280.0}),
    ("910", {"fp32": 64.0, "tf32": 64.0, "bf16": 256.0, "fp16": 256.0}),
]


@dataclass(frozen=True)
class CatalogDevice:
    family: str  # cuda | npu
    name: str  # as the runtime reports it
    memory_gib: float  # per device, as total_memory reports it
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability


# Accelerators in one server of the catalogue's kinds (HGX/DGX V100, A100, H100, H200; Atlas 800T
# A2): a plan for more of them spans servers, whose link the priors price apart.
CATALOG_NODE_DEVICES = 8

CATALOG: dict[str, CatalogDevice] = {
    "V100": CatalogDevice("cuda", "Tesla V100-SXM2-32GB", 31.7, (7, 0)),
    "A100": CatalogDevice("cuda", "NVIDIA A100-SXM4-80GB", 79.2, (8, 0)),
    "H100": CatalogDevice("cuda", "NVIDIA H100 80GB HBM3", 79.1, (9, 0)),
    "H200": CatalogDevice("cuda", "NVIDIA H200", 139.8, (9, 0)),
    "910B": CatalogDevice("npu", "Ascend910B2", 60.9),
}
