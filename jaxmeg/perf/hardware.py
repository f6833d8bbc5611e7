"""Hardware profiles (configs/hardware/*.yaml): datasheet peak, memory and link figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


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


def load_hardware(name_or_path: str) -> Hardware:
    """A profile by name (`a100_dgx`) or by path to a YAML file."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
        raise ValueError(f"unknown hardware {name_or_path!r}; known profiles: {known}")
    raw = yaml.safe_load(path.read_text())
    fields = {f.name for f in dataclasses.fields(Hardware)}
    unknown = set(raw) - fields
    if unknown:
        raise ValueError(f"{path}: unknown hardware keys {sorted(unknown)}")
    return Hardware(**raw)
