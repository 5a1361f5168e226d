"""The `tp` mesh, the arena's sharding over it, shard_map for both jax lines, multi-host start.

    mesh = tp_mesh(2)                       # the first 2 devices (of all processes) on axis "tp"
    arena_sharding(mesh)                    # NamedSharding(mesh, P("tp")): [tp, rows, words]
    f = shard_map(body, mesh, in_specs, out_specs)   # replication checks off (Pallas calls)

Multi-host: call `init_distributed(coordinator, num_processes, process_id)` in every process
before anything touches a device; `jax.devices()` then lists every process's devices.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .collectives import TP_AXIS


def tp_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh of `tp` devices named "tp" (default: the first tp of jax.devices()).

    Built with `Mesh` rather than `jax.make_mesh`: the latter makes Explicit axes on jax 0.10,
    which would make shard_map refuse inputs that are not already sharded.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; JAX sees {len(devices)} "
                         f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={tp} "
                         "before jax starts")
    return Mesh(np.array(devices[:tp]), (TP_AXIS,))


def arena_sharding(mesh: Mesh) -> NamedSharding:
    """The arena [tp, rows, words] split on its leading axis: device r holds [1, rows, words]."""
    return NamedSharding(mesh, P(TP_AXIS))


def shard_map(f, mesh: Mesh, in_specs, out_specs):
    """jax.shard_map (jax >= 0.7: check_vma) or the experimental one (check_rep), with the
    replication check off: Pallas calls carry no replication rule, and the outputs declared
    replicated (logits) are replicated by construction (every device ends with the same psum)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh, in_specs, out_specs, check_rep=False)


def init_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Start JAX's multi-process runtime (jax.distributed.initialize) -> whether it was started.

    coordinator_address "host:port" of process 0; num_processes the number of hosts; process_id
    this host's rank (0 .. num_processes-1).  Nothing is started for a single process (all None,
    or num_processes 1).  Must run before any JAX computation or device query.
    """
    if coordinator_address is None and (num_processes or 1) == 1:
        return False
    if coordinator_address is None or num_processes is None or process_id is None:
        raise ValueError("multi-host start needs --dist-init-addr, --nnodes and --node-rank together")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--node-rank {process_id} must be in [0, {num_processes})")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return True


__all__ = ["arena_sharding", "init_distributed", "shard_map", "tp_mesh"]
