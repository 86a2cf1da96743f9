"""Where target and draft live: one mesh each, built from configuration.

"split" puts the target on the first device(s) and the draft on the next ones (the user's design:
overlap through async dispatch); "colocated" puts both on the same device (the SD baseline the
paper compares against). Arrays cross meshes only through `to_mesh` (an async `device_put`).

Scale-out (docs/SCALE_OUT.md): a layout string "T+D" (e.g. "4+1", "2+2") or `target_devices` /
`draft_devices` give the target a T-device mesh with axis `model` (tensor parallelism, see
`ssd_jax.runtime.sharding`) and the draft a D-device mesh with axis `data` (data parallelism over the batch).
Meshes use `AxisType.Auto` axes so GSPMD partitions the jitted steps from the argument shardings.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

PLACEMENTS = ("split", "colocated")
_LAYOUT = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class Placement:
    """The target's mesh (one axis, `model`: tensor parallelism) and the draft's (one axis, `data`:
    data parallelism over the batch); built by `make_placement`."""

    target_mesh: Mesh
    draft_mesh: Mesh

    @property
    def target(self) -> NamedSharding:
        """Replicated over the target mesh."""
        return NamedSharding(self.target_mesh, P())

    @property
    def draft(self) -> NamedSharding:
        """Replicated over the draft mesh."""
        return NamedSharding(self.draft_mesh, P())

    @property
    def split(self) -> bool:
        """Whether target and draft have no device in common."""
        return set(self.target_mesh.devices.flat).isdisjoint(self.draft_mesh.devices.flat)

    @property
    def on_cpu(self) -> bool:
        """Whether the target's devices are CPUs (where the engine's GPU / TPU defaults, round
        chunks and batch buckets, are off)."""
        return self.target_mesh.devices.flat[0].platform == "cpu"

    @property
    def tp(self) -> int:
        """Tensor-parallel degree of the target (its mesh size)."""
        return int(self.target_mesh.devices.size)

    @property
    def dp(self) -> int:
        """Data-parallel degree of the draft (its mesh size)."""
        return int(self.draft_mesh.devices.size)

    @property
    def layout(self) -> str:
        """The layout string "T+D" (target devices + draft devices)."""
        return f"{self.tp}+{self.dp}"

    def target_rows(self, vocab: int) -> NamedSharding:
        """Where proposal rows `[B, K, V]` land on the target: sharded over the vocabulary (each byte
        crosses meshes once) when the TP degree divides V = `vocab`, else replicated."""
        if self.tp > 1 and int(vocab) % self.tp == 0:
            return NamedSharding(self.target_mesh, P(None, None, self.target_mesh.axis_names[0]))
        return self.target

    def draft_rows(self, batch: int) -> NamedSharding:
        """Where per-sequence draft arrays `[B, ...]` live: sharded over the batch (axis 0) when the
        draft mesh's size divides B = `batch`, else replicated."""
        if self.dp > 1 and int(batch) % self.dp == 0:
            return NamedSharding(self.draft_mesh, P(self.draft_mesh.axis_names[0]))
        return self.draft


def _mesh(devices, axis: str) -> Mesh:
    return Mesh(np.array(devices), (axis,), axis_types=(AxisType.Auto,))


def make_placement(kind: str = "split", devices=None, *, target_devices: int | None = None,
                   draft_devices: int | None = None) -> Placement:
    """kind: "split" | "colocated" | a layout "T+D" (split, T target and D draft devices).

    Devices are taken in order from `devices` (default `jax.local_devices()`, this process's
    devices; after `jax.distributed.initialize` pass a list drawn from `jax.devices()` for meshes
    that span processes, docs/SCALE_OUT.md): target first, then the draft ("split"), or both
    from the start ("colocated"). target_devices / draft_devices: T and D (default 1 each; a layout
    string sets both). Plain "split" on a single device falls back to sharing it."""
    m = _LAYOUT.match(str(kind))
    if m:
        t, d = int(m.group(1)), int(m.group(2))
        if (target_devices not in (None, t)) or (draft_devices not in (None, d)):
            raise ValueError(f"layout {kind!r} conflicts with target_devices={target_devices}, "
                             f"draft_devices={draft_devices}")
        kind, target_devices, draft_devices = "split", t, d
    if kind not in PLACEMENTS:
        raise ValueError(f"unknown placement {kind!r}: use one of {', '.join(PLACEMENTS)} or a "
                         f"layout 'T+D' such as '4+1'")
    devices = list(devices if devices is not None else jax.local_devices())
    explicit = target_devices is not None or draft_devices is not None
    t = int(target_devices or 1)
    d = int(draft_devices or 1)
    if t < 1 or d < 1:
        raise ValueError(f"target_devices and draft_devices must be >= 1, got {t} and {d}")
    if kind == "split":
        if len(devices) >= t + d:
            tgt, drf = devices[:t], devices[t:t + d]
        elif not explicit and len(devices) == 1:
            tgt, drf = devices[:1], devices[:1]
        else:
            raise ValueError(f"layout {t}+{d} needs {t + d} devices, found {len(devices)}")
    else:
        if len(devices) < max(t, d):
            raise ValueError(f"colocated {t}+{d} needs {max(t, d)} devices, found {len(devices)}")
        tgt, drf = devices[:t], devices[:d]
    if tgt == drf and len(tgt) == 1:
        # Both on one device (colocated, or split on a single device): one mesh, so an array
        # moving between them already has the other side's sharding and `to_mesh` skips the
        # device_put (jit refuses two meshes in one call, even over the same device).
        mesh = _mesh(tgt, "model")
        return Placement(mesh, mesh)
    return Placement(_mesh(tgt, "model"), _mesh(drf, "data"))


def spans_processes(mesh: Mesh) -> bool:
    """Whether `mesh` is a CPU mesh with devices of more than one process (multi-controller JAX).

    Its computations all-reduce and all-gather over gloo, which pairs the messages of two processes
    by the order in which they reach each collective. XLA:CPU runs independent computations
    concurrently, so two in flight at once can reach their collectives in a different order on
    each process and read each other's bytes (gloo aborts: "Received data size doesn't match").
    Such computations therefore run one at a time (`settle`); this gives up the overlap, which a
    CPU runtime spanning processes is for testing the layouts anyway. GPU collectives (NCCL) are
    ordered on each device's stream and need none of this."""
    devs = list(mesh.devices.flat)
    return devs[0].platform == "cpu" and any(d.process_index != jax.process_index() for d in devs)


def settle(tree, serial: bool):
    """`tree` once computed when `serial` (see `spans_processes`); as is, still in flight, if not."""
    if serial:
        jax.block_until_ready(tree)
    return tree


def to_mesh(tree, sharding: NamedSharding):
    """`tree`'s arrays placed with `sharding` (another mesh's), same shapes: an async `device_put`
    in one process; with several processes an array whose devices differ goes through the host
    (`to_host`), and on the CPU everything in flight finishes first."""
    if jax.process_count() == 1:
        if isinstance(tree, jax.Array) and _placed(tree, sharding):
            return tree  # the device loop's arrays, mostly: a device_put costs ~50 Python calls
        return jax.device_put(tree, sharding)
    # Multi-controller (jax.distributed): a device array moves between meshes on different device
    # sets through the host (every process runs the same round loop, so every process supplies the
    # same global value); same-device-set reshards and host values go straight to device_put.
    # CPU collectives (gloo) of concurrently running computations can pair up wrongly across
    # processes, so on the CPU everything in flight finishes first (this gives up the overlap).
    _finish_in_flight_on_cpu()

    def one(x):
        if isinstance(x, jax.Array) and x.sharding.device_set != sharding.device_set:
            x = to_host(x)
        return jax.device_put(x, sharding)

    return jax.tree_util.tree_map(one, tree)


def _finish_in_flight_on_cpu() -> None:
    """On the CPU, wait for every computation in flight (`spans_processes` says why)."""
    if jax.devices()[0].platform == "cpu":
        for a in jax.live_arrays():
            a.block_until_ready()


def move(x, sharding: NamedSharding):
    """`to_mesh` for the arrays a round moves between the meshes every round (the speculation and
    its rows, the outcome, from_backup): an array sharded over 2+ devices that are `sharding`'s
    own, laid out otherwise (a TP target and a DP draft over the same devices), is resharded by a
    jitted identity, ~2 Python calls against ~250 for its `device_put`; anything else goes
    through `to_mesh`."""
    if jax.process_count() == 1 and isinstance(x, jax.Array):
        if _placed(x, sharding):
            return x  # one device, or a colocated placement: as `to_mesh`, nothing moves
        if len(sharding.device_set) > 1 and x.sharding.device_set == sharding.device_set:
            return _reshard(sharding)(x)
    return to_mesh(x, sharding)


@functools.lru_cache(maxsize=None)
def _reshard(sharding: NamedSharding):
    """A jitted identity whose output has `sharding` (one per sharding; it traces once per input
    shape and layout)."""
    return jax.jit(lambda x: x, out_shardings=sharding)


def _placed(x: jax.Array, sharding: NamedSharding) -> bool:
    """Whether `x` already has `sharding` (the same mesh too: jit wants one mesh per call; a
    single-device placement gives target and draft one mesh, so their arrays pass as they are)."""
    have = x.sharding
    return have is sharding or have == sharding


def to_host(x) -> np.ndarray:
    """The global value of `x` (same shape) as numpy on this process (all-gathered across processes
    if needed; then every process must make the same `to_host` calls in the same order)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or (
            x.is_fully_replicated and x.addressable_shards):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    _lockstep(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def fetch(tree):
    """`tree`'s arrays as numpy on this process: `jax.device_get` (one transfer for the whole
    tree) in one process; each array's global value through `to_host` with several."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree_util.tree_map(to_host, tree)


_GATHERS = [0]


def _lockstep(x):
    """Every process reaches this gather with `x` (on the CPU, everything in flight) computed
    before any starts it. Without this, a process that finished one gather can start the next
    one's messages while the other is still inside the first, and gloo (CPU) hands them to the
    wrong receive ("Received data size doesn't match expected size"). The barrier is the
    coordination service's (not a collective), the one jax's own array serialization waits at;
    its ids count gathers, so every process must make the same `to_host` calls in the same order,
    as multi-controller JAX already requires of collectives."""
    from jax._src import distributed

    jax.block_until_ready(x)
    # the gather is a gloo collective too: a computation still in flight that was not settled (a
    # small jitted step between two reads) could meet its collectives in another order on each
    # process
    _finish_in_flight_on_cpu()
    client = distributed.global_state.client
    if client is not None:
        _GATHERS[0] += 1
        client.wait_at_barrier(f"ssd_jax_to_host_{_GATHERS[0]}", timeout_in_ms=600_000)
