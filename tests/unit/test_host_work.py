"""ssd_jax.testing.host_work's counters: a device->host sync counted once however it is asked
for (numpy, a Python value, a wait, a device_get of several arrays), nothing else counted, the time
blocked in syncs clocked apart from the host's own, the array class left as it was; Python calls
counted in the calling thread."""
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.testing.host_work import SyncCounter, count_calls, self_test


def test_one_numpy_conversion_is_one_sync_and_the_class_is_put_back():
    x, y = jnp.arange(3) + 1, jnp.float32(2.0) * 3
    jax.block_until_ready((x, y))
    cls = type(x)
    before = {m: cls.__dict__.get(m) for m in SyncCounter.METHODS}
    with SyncCounter() as s:
        np.asarray(x)  # on CPU numpy would take the buffer protocol, which no Python sees
    assert (s.syncs, s.arrays) == (1, 1) and s.by_kind == {"Array.__array__": 1}
    with SyncCounter() as s:
        jax.device_get((x, y))  # one wait for two arrays; its inner __array__ is not counted again
        np.asarray(np.arange(3))  # a numpy array: no sync
        _ = x + 1, x.shape, len(x)  # device work and metadata: no sync
    assert (s.syncs, s.arrays) == (1, 2)
    with SyncCounter() as s:
        int(x[0]), float(y), x.tolist(), x.block_until_ready(), bool(x[0] > 0)
    assert s.syncs == 5
    # the wait clock counts time blocked in a sync, not the host's own time between syncs
    heavy = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    a = jnp.ones((1500, 1500))
    heavy(a).block_until_ready()  # compiled
    t0 = time.perf_counter()
    heavy(a).block_until_ready()
    alone = time.perf_counter() - t0
    with SyncCounter() as s:
        z = heavy(a)  # dispatched: the host goes on while the device computes
        np.asarray(z)
    assert s.wait_s >= 0.3 * alone, (s.wait_s, alone)
    with SyncCounter() as s:
        time.sleep(0.2)
        np.asarray(x)
    assert s.wait_s < 0.1, s.wait_s
    # everything is put back: the methods and the buffer protocol
    assert {m: cls.__dict__.get(m) for m in SyncCounter.METHODS} == before
    assert bytes(memoryview(np.asarray(x))) == bytes(memoryview(x))
    assert self_test()["np.asarray"] == 1


def test_python_calls_are_counted_in_this_thread():
    def inner():
        return abs(-1)  # one builtin call

    def outer():
        return [inner(), inner()]

    out, py, c = count_calls(outer)
    assert out == [1, 1]
    assert (py, c) == (3, 2)  # outer and inner twice; abs twice (not setprofile itself)
