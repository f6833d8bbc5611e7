"""Compiling for GPUs this machine does not have: XLA's GPU compiler on compile-only devices.

With the CUDA plugin installed (`pip install "jax[cuda12]==<jax's version>"`; it brings ptxas
and the CUDA libraries the compiler needs) and `JAX_PLATFORMS=cpu` set before jax starts (so the
plugin makes no CUDA client, which would fail without a GPU), the plugin's topology factory still
describes GPUs from XLA's target spec (a `GpuTargetConfig` text proto: configs/hardware/xla/,
named by a hardware profile's `xla_target`). A mesh over those devices makes
`jit(step).lower(...).compile()` produce the program an H100 would run: its memory
(`memory_analysis()`), its kernels (cuBLAS GEMMs, cuDNN attention, fusions) and the
latency-hiding scheduler's placement of every asynchronous collective (`compiled.as_text()`).
Nothing runs; `cost_analysis()` is not supported for such a program.

What it cannot show: without a GPU XLA does not autotune, so GEMMs are compiled as cuBLAS calls
(`xla_gpu_enable_triton_gemm` off: what autotuning picks for large GEMMs) and fusions keep
their default tiles. A target of several nodes (`gpus` > `gpus_per_node`) compiles the one SPMD
program every device runs over the whole mesh, collectives across nodes included; NCCL's own
choice of algorithm, link contention and timings are a real cluster's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from pathlib import Path

from jaxmeg.perf.hardware import PROFILE_DIR, Hardware, load_hardware

GPU_MEMORY_FRACTION = 0.92
"""Share of a GPU's memory the run may use (`XLA_PYTHON_CLIENT_MEM_FRACTION`, set by
`scripts/slurm/train.sbatch` and by the scripts on GPUs unless the environment says otherwise):
the rest is for the CUDA context, NCCL and cuDNN workspaces."""

GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_reduce_combine_threshold_bytes": 134217728,
    "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 134217728,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_dot_merger_threshold_mb": 0,
}
"""XLA options of every GPU compile of the train step, on a GPU or for a target: overlap
collectives with compute (the latency-hiding scheduler), combine small reductions. No dot
merger: it joins GEMMs that share an operand and whose other operands are small (under 32 MB)
by concatenating those operands and slicing the joined output, which undoes the model's one
GEMM per part of q, k, v (`parts.stacked_matmul`), and with `model.fp8` puts a concatenate
between the FP8 values and the GEMM, so the merged GEMM ran 16-bit (an expert-4 Llama MoE stack
on the H100 target: 320 of 432 GEMMs FP8; 432 without merging)."""

POINT_TO_POINT_OPTIONS = {
    "xla_gpu_collective_permute_decomposer_threshold": 0,
    "xla_gpu_enable_pipelined_p2p": True,
}
"""Where the pipe sends allow it (`pipeline_step.sends_point_to_point`): each collective-permute
becomes a send and a recv on streams of their own. A collective-permute shares the collective
stream with the tensor all-reduces inside the slots, so the latency-hiding scheduler cannot
keep one in flight across a slot that holds them: on (data 2, pipe 2, tensor 2) no pipe send
overlapped a GEMM; as send/recv every one does. Not where the slots hold no collectives (a
collective-permute overlaps there already, and a send costs copies), nor for cyclic pairs (the
interleaved placement's wrap-around, a context ring): XLA 0.10.2 aborts in its p2p scheduling
there."""

TARGET_ONLY_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_cub_radix_sort": False}
"""Without a GPU nothing is autotuned: GEMMs as cuBLAS calls, not Triton fusions with a
default tile. Sorts (a MoE layer's rows by expert) as XLA's own sort kernels: CUB's radix sort
asks the CUDA runtime for its scratch size while compiling, which fails without a device
("invalid device ordinal")."""


class TargetError(RuntimeError):
    """A GPU target cannot be compiled for on this machine (plugin missing, jax started)."""


def install_command() -> str:
    import jax

    return f'pip install "jax[cuda12]=={jax.__version__}"'


def plugin_installed() -> bool:
    """Whether jax's CUDA plugin (and with it XLA's GPU compiler) is installed. `find_spec` of
    a dotted name imports its parent and raises when the parent (`jax_plugins`, a namespace
    the plugin brings) is missing: that, too, is "not installed"."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def keep_cuda_off() -> None:
    """Before jax starts: only the CPU backend, so an installed CUDA plugin makes no client
    (no GPU here) yet can still describe target devices."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_platforms", "cpu")  # jax may be imported already, not yet started


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """`gpus` compile-only devices of the GPU a hardware profile describes."""

    hardware: Hardware
    gpus: int

    @property
    def spec_path(self) -> Path:
        return PROFILE_DIR / self.hardware.xla_target

    @property
    def hosts(self) -> int:
        return -(-self.gpus // self.hardware.gpus_per_node)

    @functools.cached_property
    def devices(self) -> list:
        """The compile-only devices, `gpus_per_node` per host (their `process_index`)."""
        from jax.experimental import topologies

        if not plugin_installed():
            raise TargetError(
                f"compiling for {self.hardware.name} needs jax's CUDA plugin, not installed "
                f"here: {install_command()}"
            )
        per_host = self.gpus // self.hosts
        if per_host * self.hosts != self.gpus or (
            self.hosts > 1 and per_host < self.hardware.gpus_per_node
        ):
            raise TargetError(
                f"--gpus {self.gpus} is not a whole number of {self.hardware.name} nodes of "
                f"{self.hardware.gpus_per_node} GPUs (nor fewer than one node)"
            )
        try:
            topology = topologies.get_topology_desc(
                platform="cuda",
                topology=f"1x{self.hosts}x{per_host}",
                target_config=self.spec_path.read_text(),
            )
        except Exception as err:  # noqa: BLE001 - the plugin's errors are plain runtime errors
            raise TargetError(
                f"cannot describe {self.gpus} x {self.hardware.name} for compiling: {err}; "
                f"set JAX_PLATFORMS=cpu before jax starts (the scripts do with --target)"
            ) from err
        return list(topology.devices)

    @property
    def device_memory_bytes(self) -> int:
        """The GPU's memory as its XLA spec gives it (`device_memory_size`)."""
        for line in self.spec_path.read_text().splitlines():
            key, _, value = line.strip().partition(":")
            if key == "device_memory_size":
                return int(value)
        return int(self.hardware.memory_gb * 1e9)

    @property
    def usable_memory_bytes(self) -> int:
        return int(self.device_memory_bytes * GPU_MEMORY_FRACTION)

    def describe(self) -> str:
        return f"{self.gpus} x {self.devices[0].device_kind} ({self.hardware.name}, compile only)"


def load_target(name: str, gpus: int) -> GpuTarget:
    """The target of hardware profile `name` (configs/hardware/NAME.yaml, or `h100` for
    `h100_dgx`) with `gpus` devices. ValueError for an unknown name or a profile without an
    XLA spec."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    hw = _profile(name)
    if not hw.xla_target:
        with_spec = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml") if _has_spec(p.stem))
        raise ValueError(
            f"hardware profile {hw.name!r} names no XLA target spec (xla_target); targets: "
            f"{with_spec}"
        )
    return GpuTarget(hw, gpus)


def _profile(name: str) -> Hardware:
    try:
        return load_hardware(name)
    except ValueError:
        if (PROFILE_DIR / f"{name}_dgx.yaml").is_file():
            return load_hardware(f"{name}_dgx")
        raise


def _has_spec(name: str) -> bool:
    return bool(load_hardware(name).xla_target)


def compiler_options(platform: str, point_to_point: bool = False) -> dict:
    """XLA options for compiling the step for devices of `platform`: a GPU's (with
    `point_to_point` the pipe sends as send/recv), and for GPUs this machine does not have
    (jax's backend is not `gpu`) also the target-only ones."""
    if platform != "gpu":
        return {}
    import jax

    target = jax.default_backend() != "gpu"
    options = {
        **GPU_COMPILER_OPTIONS,
        **(POINT_TO_POINT_OPTIONS if point_to_point else {}),
        **(TARGET_ONLY_OPTIONS if target else {}),
    }
    if target:  # the target compiler is the pinned plugin's, which knows every option above
        return options
    return {name: value for name, value in options.items() if _known_on_gpu(name, value)}


@functools.cache
def _known_on_gpu(name: str, value) -> bool:
    """Whether this GPU's XLA accepts the option: another jax release may have dropped one
    (0.11.2 has no `xla_gpu_enable_pipelined_all_reduce`), which would stop every compile.
    One trivial compile per option, once per process; a dropped option is said, not fatal."""
    import jax

    try:
        jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(1.0).compile()
    except jax.errors.JaxRuntimeError as error:
        if "No such compile option" not in str(error):
            raise
        print(
            f"warning: this jax {jax.__version__}'s XLA has no option {name}; compiling without it",
            file=sys.stderr,
        )
        return False
    return True
