"""Where target and draft live: one mesh each, built from configuration.

"split" puts the target on the first device(s) and the draft on the next ones (the user's design:
overlap through async dispatch); "colocated" puts both on the same device (the SD baseline the
paper compares against). Arrays cross meshes only through `to_mesh` (an async `device_put`).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

PLACEMENTS = ("split", "colocated")


@dataclasses.dataclass(frozen=True)
class Placement:
    target_mesh: Mesh
    draft_mesh: Mesh

    @property
    def target(self) -> NamedSharding:
        return NamedSharding(self.target_mesh, P())

    @property
    def draft(self) -> NamedSharding:
        return NamedSharding(self.draft_mesh, P())

    @property
    def split(self) -> bool:
        return set(self.target_mesh.devices.flat).isdisjoint(self.draft_mesh.devices.flat)


def make_placement(kind: str = "split", devices=None) -> Placement:
    if kind not in PLACEMENTS:
        raise ValueError(f"unknown placement {kind!r}: use one of {', '.join(PLACEMENTS)}")
    devices = list(devices if devices is not None else jax.devices())
    t = devices[0]
    d = devices[1] if kind == "split" and len(devices) > 1 else devices[0]
    return Placement(Mesh(np.array([t]), ("model",)), Mesh(np.array([d]), ("model",)))


def to_mesh(tree, sharding: NamedSharding):
    return jax.device_put(tree, sharding)
