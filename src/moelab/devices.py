"""Accelerators moelab plans for: memory per device and published dense peaks per compute dtype.

Memory in GB (1e9 bytes) as sold; peaks in FLOP/s, dense (no sparsity), from the vendors' data
sheets: H100 and H200 SXM (989 TFLOP/s bf16, 67 fp32), GB200 per Blackwell GPU (NVL72's 180
PFLOP/s bf16 and 5,760 TFLOP/s fp32 over 72 GPUs), TF32 (what a float32 matmul runs as on their tensor
cores under JAX's default precision: half the data sheets' with-sparsity figures, 989 and 180 PFLOP/s
over 72), TPU v5p (459 bf16) and v6e (918 bf16). TPUs
publish no fp32 matmul peak: MFU in fp32 there needs ``train.peak_flops``. On a CPU the peak is
measured (``moelab.cache.cached_matmul_peak``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float
    peak: dict[str, float]  # compute dtype -> FLOP/s
    kinds: tuple[str, ...]  # substrings of jax's device_kind that name it (lower case)
    host_gb: float = 0.0  # host (CPU) memory per device, for offloaded state: see HOST_NOTES


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("H100", 80, {"bfloat16": 989e12, "tensorfloat32": 494.5e12, "float32": 67e12}, ("h100",), 256),
        Device("H200", 141, {"bfloat16": 989e12, "tensorfloat32": 494.5e12, "float32": 67e12}, ("h200",), 256),
        Device("GB200", 192, {"bfloat16": 2.5e15, "tensorfloat32": 1.25e15, "float32": 80e12}, ("gb200", "b200"), 240),
        Device("TPU v5p", 95, {"bfloat16": 459e12}, ("tpu v5p", "tpu v5"), 112),
        Device("TPU v6e", 32, {"bfloat16": 918e12}, ("tpu v6e", "tpu v6 lite", "tpu v6"), 180),
    )
}


# where each device's host memory comes from (``host_gb``): what the plan assumes, to be overridden
# with ``moelab plan memory --host-memory GB`` for another machine
HOST_NOTES = {
    "H100": "assumed: a DGX/HGX H100 node's 2 TB of system memory shared by its 8 GPUs",
    "H200": "assumed: a DGX/HGX H200 node's 2 TB of system memory shared by its 8 GPUs",
    "GB200": "a Grace CPU's 480 GB of LPDDR5X shared by the two Blackwell GPUs of a GB200 superchip",
    "TPU v5p": "assumed: a v5p host VM's ~448 GB shared by its 4 chips",
    "TPU v6e": "assumed: a v6e host VM's ~1,440 GB shared by its 8 chips",
}


def lookup(name: str) -> Device | None:
    """A device by its table name, case and spaces aside (``gb200``, ``tpu-v5p`` and ``TPU v5p`` alike)."""
    key = name.lower().replace("-", " ").replace("_", " ").strip()
    for d in DEVICES.values():
        if key.replace(" ", "") == d.name.lower().replace(" ", ""):
            return d
    return None


def of_kind(device_kind: str) -> Device | None:
    """The table's device for a jax ``device_kind`` ("NVIDIA H100 80GB HBM3", "TPU v5p"...), else None."""
    kind = device_kind.lower()
    if "v5 lite" in kind or "v5e" in kind:  # v5e is not v5p
        return None
    for d in DEVICES.values():
        if any(k in kind for k in d.kinds):
            return d
    return None


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """The published dense peak of a jax device kind in ``dtype``; None when the table has none."""
    d = of_kind(device_kind)
    return None if d is None else d.peak.get(dtype)
