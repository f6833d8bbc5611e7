"""A run's device placement and stage partition, settled before the config is validated.

With a cluster file (`scripts/train.py --cluster`), `jaxmeg.parallel.placement` decides which
device takes which mesh coordinate and so which node group each pipeline stage runs on. Then
`parallel.stage_layers` may be a word instead of a list:
  auto      layers per stage that minimise the slowest stage's time (`jaxmeg.perf.partition`),
            stage costs from the performance model for each stage's group (GPU profile, data-
            parallel reduction over the group's NIC); without a cluster file, the same model
            with the profile of the devices the run has (configs/hardware/: `cpu` for CPU
            devices, the one that names the GPU otherwise), all on one node group;
  measured  the same partitioner fed by a short probe on the devices (`stage_probe`), saved in
            the run directory and reused when the run resumes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from jaxmeg.config import Config, ConfigError, resolve_mesh_shape, validate
from jaxmeg.parallel.cluster import Cluster, NodeGroup
from jaxmeg.parallel.placement import Placement, place
from jaxmeg.perf.cluster_model import stage_costs_for_config
from jaxmeg.perf.hardware import profile_for_device
from jaxmeg.perf.partition import StageCost, balance


@dataclasses.dataclass(frozen=True)
class RunLayout:
    cfg: Config
    """Validated, `parallel.stage_layers` a list."""
    placement: Placement | None
    """None = Megatron's device order without a cluster file."""
    costs: tuple[StageCost, ...] = ()
    """The stage costs an `auto` or `measured` partition was chosen from."""
    source: str = ""
    """Where the costs came from (performance model, probe, saved probe)."""


def _with_stage_layers(cfg: Config, stage_layers) -> Config:
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, stage_layers=tuple(stage_layers))
    )


LOCAL_GROUP = "local"
"""The node group of a run without a cluster file."""


def local_cluster(devices: Sequence[jax.Device]) -> Cluster:
    """The run's devices as one node group of their hardware profile (no cluster file): one
    node per process. ConfigError when no profile in configs/hardware/ names the device."""
    device = devices[0]
    hw = profile_for_device(device.platform, device.device_kind)
    if hw is None:
        raise ConfigError(
            f"parallel.stage_layers=auto: no hardware profile in configs/hardware/ names the "
            f"device kind {device.device_kind!r}; add one (its `device_kinds`), pass a cluster "
            f"file (--cluster), or use parallel.stage_layers=measured"
        )
    nodes = len({d.process_index for d in devices})
    per_node = len(devices) // nodes
    nic = "ethernet" if device.platform == "cpu" else "infiniband"
    group = NodeGroup(LOCAL_GROUP, nodes, per_node, hw.name, nic,
                      nic_gbps=hw.inter_node_gb_per_s * 8 * per_node)  # fmt: skip
    return Cluster(f"{nodes} node(s) of {per_node} {hw.name}", (group,))


def model_costs(
    cfg: Config, job, placement: Placement | None, devices: Sequence[jax.Device]
) -> list[StageCost]:
    """Per-stage costs from the performance model: by node group with a cluster file; without
    one, on the run's own devices (`local_cluster`)."""
    if job is not None:
        return stage_costs_for_config(cfg, job.cluster, placement.stage_groups(), placement)
    cluster = local_cluster(devices)
    return stage_costs_for_config(cfg, cluster, [LOCAL_GROUP] * cfg.parallel.pipe)


def resolve(
    cfg: Config,
    job=None,
    out_dir: str | None = None,
    partition: bool = True,
    devices: Sequence[jax.Device] | int | None = None,
) -> RunLayout:
    """Validates `cfg` (vocabulary known) for this job's devices, places them, and turns
    `parallel.stage_layers: auto | measured` into a list (with `partition=False`, only checks
    that it can: no probe runs). Raises ConfigError before any compile for a layout that cannot
    be placed or partitioned."""
    par = cfg.parallel
    if devices is None or isinstance(devices, int):  # a count: validation only
        run_devices = list(jax.devices())
        devices = len(run_devices) if devices is None else devices
    else:
        run_devices = list(devices)
        devices = len(run_devices)
    if job is not None and par.context > 1 and isinstance(par.stage_layers, str):
        raise ConfigError(
            f"parallel.stage_layers={par.stage_layers} with a cluster file is priced for "
            f"parallel.context = 1, got {par.context}; give the stage layers as a list"
        )
    records = job.device_records() if job is not None else None  # the cluster fits the devices
    mode = par.stage_layers if isinstance(par.stage_layers, str) else None
    if mode:
        pipe = resolve_mesh_shape(par, devices)[1]
        if cfg.stacked_layers < pipe:
            raise ConfigError(
                f"parallel.stage_layers={mode} needs {cfg.stacked_layers_field} "
                f"({cfg.stacked_layers}) >= parallel.pipe ({pipe})"
            )
        cfg = _with_stage_layers(cfg, balance([StageCost(1.0)] * pipe, cfg.stacked_layers))
    cfg = validate(cfg, devices)
    placement = None
    if job is not None:
        d, p, c, e, t = (cfg.parallel.data, cfg.parallel.pipe, cfg.parallel.context,
                         cfg.parallel.expert, cfg.parallel.tensor)  # fmt: skip
        # a context or expert group is placed as tensor groups are: c e t devices of one host
        # (one NIC type); `make_mesh` splits the placement's [d, p, c e t] grid into
        # [d, p, c, e, t]
        placement = place(records, job.cluster.group_names, d, p, c * e * t, par.placement,
                          par.outer_axis)  # fmt: skip
    if not mode or not partition:
        return RunLayout(cfg, placement)
    if mode == "auto":
        costs, source = model_costs(cfg, job, placement, run_devices), "performance model"
    else:
        from jaxmeg.training.stage_probe import probe_costs

        costs, source = probe_costs(cfg, placement, out_dir)
    layers = balance(costs, cfg.stacked_layers)
    return RunLayout(validate(_with_stage_layers(cfg, layers), devices), placement, tuple(costs),
                     source)  # fmt: skip
