"""Hardware profiles (configs/hardware/*.yaml): datasheet peak, memory and link figures.

The profiles are the one home of every GPU's peak TFLOP/s: the performance model reads a profile
by name, and MFU reporting finds the profile whose GPU matches the running device's kind.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from jaxmeg.shipped import find_shipped, shipped_dir, shipped_names
from jaxmeg.yaml_files import read_mapping

PROFILE_DIR = shipped_dir("hardware")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    """Profile name (the YAML file's stem)."""
    gpus_per_node: int
    """GPUs that share the fast intra-node fabric (NVLink/NVSwitch)."""
    peak_tflops: float
    """Dense bf16 tensor-core peak per GPU."""
    memory_gb: float
    """Device memory per GPU."""
    hbm_tb_per_s: float
    """Device memory bandwidth, for memory-bound kernels and the optimizer step."""
    intra_node_gb_per_s: float
    """Per-GPU, per-direction bandwidth inside a node."""
    inter_node_gb_per_s: float
    """Per-GPU, per-direction bandwidth between nodes."""
    intra_node_latency_us: float
    """Latency of one collective step inside a node."""
    inter_node_latency_us: float
    """Latency of one collective step between nodes."""
    gemm_efficiency: float
    """Fraction of peak that a large bf16 GEMM reaches."""
    gemm_half_dim: int
    """GEMM dimension at which efficiency along that dim is halved (small shapes run slower)."""
    collective_efficiency: float = 0.75
    """Fraction of a link's datasheet bandwidth that NCCL collectives reach (bus bandwidth)."""
    workspace_gb: float = 2.0
    """Memory held by libraries and the allocator, per GPU."""
    device_kinds: tuple[str, ...] = ()
    """Names of this GPU in jax's `device.device_kind` (e.g. `H100` in `NVIDIA H100 80GB
    HBM3`), matched as substrings with case, spaces and dashes ignored; `peak_tflops` is theirs."""
    variant_peak_tflops: dict[str, float] = dataclasses.field(default_factory=dict)
    """Other parts of the same GPU that run at a different peak, device kind -> dense bf16
    TFLOP/s (e.g. `H100 PCIe`); matched like `device_kinds`, the longest match wins."""
    fp8_peak_tflops: float = 0.0
    """Dense FP8 tensor-core peak per GPU; 0: the GPU has no FP8 GEMMs (`model.fp8` is refused
    on it)."""
    xla_target: str = ""
    """XLA's description of the GPU (a `GpuTargetConfig` text proto), relative to
    configs/hardware/: what `--target` compiles for (`jaxmeg.parallel.gpu_target`)."""


def gemm_seconds(m: float, n: float, k: float, hw: Hardware, fp8: bool = False) -> float:
    """2 m n k FLOPs at the profile's GEMM efficiency, lower along each dimension below
    `gemm_half_dim` (tile quantisation and launch overheads), or the HBM roofline; `fp8`: at
    the FP8 peak, its operands 1 byte each (the result stays 16-bit)."""
    c = hw.gemm_half_dim
    efficiency = hw.gemm_efficiency * (m / (m + c)) * (n / (n + c)) * (k / (k + c))
    peak = hw.fp8_peak_tflops if fp8 else hw.peak_tflops
    compute = 2 * m * n * k / (peak * 1e12 * efficiency)
    operand = 1 if fp8 else 2
    memory = (operand * (m * k + k * n) + 2 * m * n) / (hw.hbm_tb_per_s * 1e12)
    return max(compute, memory)


def load_hardware(name_or_path: str) -> Hardware:
    """A profile by name (`a100_dgx`) or by path to a YAML file."""
    path = find_shipped("hardware", name_or_path)
    if path is None:
        known = shipped_names("hardware")
        raise ValueError(f"unknown hardware {name_or_path!r}; known profiles: {known}")
    raw = read_mapping(path, "hardware file")
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = set(raw) - fields
    if unknown:
        raise ValueError(f"{path}: unknown hardware keys {sorted(unknown)}")
    raw["device_kinds"] = tuple(raw.get("device_kinds", ()))
    try:
        return Hardware(**raw)
    except TypeError as err:  # a key the profile needs is missing
        raise ValueError(f"{path}: {err.args[0].split('__init__() ')[-1]}") from None


@functools.cache
def all_profiles() -> tuple[Hardware, ...]:
    """Every profile in configs/hardware/, by name."""
    return tuple(load_hardware(str(path)) for path in sorted(PROFILE_DIR.glob("*.yaml")))


def _squeezed(kind: str) -> str:
    return re.sub(r"[\s_-]", "", kind).upper()


def profile_for_device_kind(kind: str) -> Hardware | None:
    """The profile of the GPU named `kind` (jax's `device_kind`): the profile with the longest
    name in its `device_kinds` or `variant_peak_tflops` that `kind` contains, so `H100 PCIe`
    wins over `H100`, with that name's peak. None when no profile names it; ValueError when two
    profiles give the same name different peaks."""
    squeezed = _squeezed(kind)
    matches: dict[str, dict[float, list[Hardware]]] = {}
    for hw in all_profiles():
        named = {name: hw.peak_tflops for name in hw.device_kinds} | hw.variant_peak_tflops
        for name, peak in named.items():
            if _squeezed(name) in squeezed:
                matches.setdefault(_squeezed(name), {}).setdefault(float(peak), []).append(hw)
    if not matches:
        return None
    name = max(matches, key=len)
    if len(matches[name]) > 1:
        names = {peak: [hw.name for hw in hws] for peak, hws in matches[name].items()}
        raise ValueError(f"hardware profiles disagree on the peak of {name!r}: {names}")
    ((peak, profiles),) = matches[name].items()
    return dataclasses.replace(profiles[0], peak_tflops=peak)


def peak_tflops_for_device_kind(kind: str) -> float | None:
    """Dense bf16 peak of the GPU named `kind` (`profile_for_device_kind`), None if unknown."""
    hw = profile_for_device_kind(kind)
    return None if hw is None else hw.peak_tflops


CPU_PROFILE = "cpu"
"""The profile of simulated CPU devices (configs/hardware/cpu.yaml)."""


def profile_for_device(platform: str, kind: str) -> Hardware | None:
    """The profile of a jax device (`device.platform`, `device.device_kind`): `cpu` for CPU
    devices, the profile that names the GPU otherwise; None when none does."""
    if platform == "cpu":
        return load_hardware(CPU_PROFILE)
    return profile_for_device_kind(kind)
