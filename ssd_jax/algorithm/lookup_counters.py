"""SSD's speculation-cache lookup counters, kept per row on the draft mesh (`LookupCounters`), and
the index of each backup speculator in them (`BACKUP_INDEX`).

Their own module because the step store (`ssd_jax.algorithm.aot`) registers the counters as a
step output before it reads a stored step, and `round_steps`, which updates them, imports `aot`.
"""
from __future__ import annotations

from flax import struct
import jax

from ssd_jax.algorithm.backups import BACKUPS


@struct.dataclass
class LookupCounters:
    """SSD's lookup counters on the draft mesh, per row: lookups_by_accept / hits_by_accept
    `[B, K+1]` by the accepted count looked up; backups `[B, len(BACKUPS)]`: rounds the row was
    served by each backup speculator (`BACKUP_INDEX`, in `backups.BACKUPS`'s order). Per row, so
    a round adds to them without a reduction across rows (on a data-parallel draft, a collective
    between its shards); the host sums them once a call (`totals`)."""
    lookups_by_accept: jax.Array
    hits_by_accept: jax.Array
    backups: jax.Array

    @classmethod
    def zeros(cls, k: int, batch: int) -> "LookupCounters":
        """Zero counters for lookahead k and `batch` rows (host arrays, placed by the caller)."""
        import numpy as np
        z = np.zeros((batch, k + 1), np.int32)
        return cls(lookups_by_accept=z, hits_by_accept=z.copy(),
                   backups=np.zeros((batch, len(BACKUP_INDEX)), np.int32))

    def totals(self) -> "LookupCounters":
        """Host side, on fetched counters: the call's counts, summed over the rows."""
        import numpy as np
        return LookupCounters(*(np.asarray(x, np.int64).sum(0) for x in
                                (self.lookups_by_accept, self.hits_by_accept, self.backups)))


BACKUP_INDEX = {kind: i for i, kind in enumerate(BACKUPS)}  # the counters' column of each kind
