"""Weight formats that can fill the same slot of Params have treedefs of their own.

JAX 0.10.2 compares two `register_dataclass` nodes (flax.struct.dataclass uses it) with as many
children and equal static fields as equal whatever their classes, while their hashes differ. jit's
dispatch cache trusts that equality, so a call whose signature hash meets another's in its table can
run the other's program: a CI run got the tiled int8 kernel on a row-major `Int8Weight` (a
`TiledInt8Weight` of the same shapes had been called just before). Classes that never share a slot
(KVCache and VerifyResult compare equal too) cannot meet that way; the weight formats can, so each
backend layout carries a static `layout` field (models/cpu/layouts.py).
"""
import dataclasses
import importlib
import itertools
import pkgutil

import jax
import jax.numpy as jnp

import ssd_jax
import ssd_jax.models
import ssd_jax.pallas_kernels


def _dataclass_nodes() -> list[type]:
    classes = {}
    for pkg in (ssd_jax, ssd_jax.models, ssd_jax.pallas_kernels):
        names = [pkg.__name__] + [m.name for m in
                                  pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
        for name in names:
            module = importlib.import_module(name)  # an import error fails the test, naming it
            for obj in vars(module).values():
                if (isinstance(obj, type) and dataclasses.is_dataclass(obj)
                        and obj.__module__ == module.__name__ and _structure(obj) is not None):
                    classes[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [classes[k] for k in sorted(classes)]


def _instance(cls, leaf):
    """An instance with `leaf` in every pytree field and each static field's default (or None),
    made without __init__ (some validate their fields)."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("pytree_node", True):
            value = leaf
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = None
        object.__setattr__(obj, f.name, value)
    return obj


def _structure(cls, leaf=None):
    """cls's treedef with `leaf` in its fields; None where cls is not a pytree node."""
    treedef = jax.tree.structure(_instance(cls, jnp.zeros(2) if leaf is None else leaf))
    return None if treedef.num_nodes == 1 else treedef


def test_the_package_defines_the_node_classes_it_is_known_to():
    names = {c.__name__ for c in _dataclass_nodes()}
    # a move or a rename must update this (and WEIGHT_FORMATS below)
    assert {"Int8Weight", "TiledInt8Weight", "Int4Weight", "Int4Tiles", "PackedWeight", "Params",
            "LayerParams", "KVCache", "SpeculationCache", "DecodeState", "VerifyResult"} <= names


# Everything a dense weight slot of Params may hold: the logical formats and every backend layout.
WEIGHT_FORMATS = ("Int8Weight", "Int4Weight", "TiledInt8Weight", "PackedWeight", "Int4Tiles")


def test_no_two_weight_formats_share_a_structure():
    """A jitted step that takes params in one format must never run on params in another: with the
    same leaves (the worst case: same shapes and dtypes) their treedefs must differ."""
    leaf = jnp.zeros(2)
    nodes = {c.__name__: c for c in _dataclass_nodes()}
    formats = [nodes[n] for n in WEIGHT_FORMATS]
    for cls in formats:  # a class against itself: equal, or the check below proves nothing
        assert _structure(cls, leaf) == _structure(cls, leaf), cls
    same = [(a.__name__, b.__name__) for a, b in itertools.combinations(formats, 2)
            if _structure(a, leaf) == _structure(b, leaf)]
    assert not same, (f"these weight formats have equal treedefs, so jit may run one's program "
                      f"on the other: {same} (give the layout a static field, as "
                      f"models/cpu/layouts.py does)")


def test_every_backend_layout_is_a_weight_format_here():
    """A new layout class in a backend must join WEIGHT_FORMATS, or the check above misses it."""
    layouts = {c.__name__ for c in _dataclass_nodes() if ".cpu.layouts" in c.__module__}
    assert layouts <= set(WEIGHT_FORMATS), layouts - set(WEIGHT_FORMATS)


def test_a_tiled_int8_weight_and_its_row_major_twin_are_told_apart():
    from ssd_jax.models.cpu.layouts import TiledInt8Weight
    from ssd_jax.models.weights import Int8Weight
    q, s = jnp.zeros((16, 32), jnp.int8), jnp.ones((32,), jnp.float32)
    tiled, row_major = TiledInt8Weight(q=q, scale=s), Int8Weight(q=q, scale=s)
    assert jax.tree.structure(tiled) != jax.tree.structure(row_major)
