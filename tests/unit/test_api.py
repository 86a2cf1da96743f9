"""The public API: `ssd_jax.__all__` resolves lazily and is documented, `python -m ssd_jax` runs, and
every public function and class of the documented modules has a docstring of its own."""
import dataclasses
import importlib
import inspect
import subprocess
import sys

import pytest

import ssd_jax

# The modules whose public functions, classes and methods must each carry a docstring.
def _all_modules() -> list[str]:
    """Every module of the installed package (the GPU benchmark script aside: it is a script)."""
    import pkgutil

    import ssd_jax.models
    import ssd_jax.pallas_kernels
    names = set()
    # ssd_jax.models and ssd_jax.pallas_kernels live in folders of their own (package-dir)
    for pkg in (ssd_jax, ssd_jax.models, ssd_jax.pallas_kernels):
        names.add(pkg.__name__)
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not info.name.endswith(("bench_gpu", "__main__")):
                names.add(info.name)
    return sorted(names)


DOCUMENTED_MODULES = _all_modules()


def _own_doc(obj) -> str:
    """obj's own docstring: a class's is not inherited from its bases, and the signature that
    `dataclasses` writes into an undocumented dataclass does not count."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__") or ""
        if doc.startswith(obj.__name__ + "("):
            return ""
        return doc.strip()
    return (getattr(obj, "__doc__", None) or "").strip()


def _public_members(module):
    """(name, object) of the public functions and classes defined in `module` itself (jitted
    functions included: jax.jit keeps the wrapped function's __module__ and __doc__)."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not callable(obj):
            continue
        if getattr(obj, "__module__", None) == module.__name__:
            yield name, obj


def _public_methods(cls, module_name):
    """(name, function) of the public methods and properties written in `cls`'s own body."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for name, attr in vars(cls).items():
        if name.startswith("_") or name in fields:  # a field whose default is a function
            continue
        if isinstance(attr, property):
            fn = attr.fget
        elif isinstance(attr, (classmethod, staticmethod)):
            fn = attr.__func__
        else:
            fn = attr
        if inspect.isfunction(fn) and fn.__module__ == module_name:
            yield name, fn


@pytest.mark.parametrize("name", ssd_jax.__all__)
def test_every_exported_name_resolves_and_is_documented(name):
    obj = getattr(ssd_jax, name)
    if inspect.isclass(obj) or callable(obj):
        assert _own_doc(obj), f"ssd_jax.{name} has no docstring"


def test_dir_lists_every_exported_name():
    listed = dir(ssd_jax)
    assert [n for n in ssd_jax.__all__ if n not in listed] == []


def test_unknown_attribute_raises_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no_such_name_xyz"):
        ssd_jax.no_such_name_xyz  # noqa: B018
    assert not hasattr(ssd_jax, "no_such_name_xyz")


def test_python_m_ssd_jax_help_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "ssd_jax", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


@pytest.mark.parametrize("module_name", DOCUMENTED_MODULES)
def test_public_functions_and_classes_have_docstrings(module_name):
    module = importlib.import_module(module_name)
    assert (module.__doc__ or "").strip(), f"{module_name} has no module docstring"
    missing = []
    for name, obj in _public_members(module):
        if not _own_doc(obj):
            missing.append(name)
        if inspect.isclass(obj):
            missing += [f"{name}.{m}" for m, fn in _public_methods(obj, module_name)
                        if not _own_doc(fn)]
    assert missing == [], f"{module_name}: no docstring for {missing}"


def test_the_version_is_the_installed_distributions():
    from importlib.metadata import version
    assert ssd_jax.__version__ == version("ssd_jax")


def test_no_two_modules_import_each_other_even_lazily():
    """The package's imports go one way (docs/ARCHITECTURE.md): no chain of imports, top-level or
    inside a function, leads from a module back to itself. A lazy import that closes a circle
    hides the circle, it does not remove it (it broke twice: `aot` <-> `round_steps`,
    `bench` -> `bench_paper` -> `cli` -> `bench`)."""
    import ast
    import importlib.util

    graph = {}
    for name in DOCUMENTED_MODULES:
        path = importlib.util.find_spec(name).origin
        tree = ast.parse(open(path, encoding="utf-8").read())
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                # `from pkg import sub` imports the module pkg.sub; `from pkg import name`, pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in DOCUMENTED_MODULES
                           else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in DOCUMENTED_MODULES:
                    t = t.rpartition(".")[0]
                # a package importing its own modules is how a package is built, not a circle
                if t and t != name and not name.startswith(t + "."):
                    deps.add(t)
        graph[name] = deps

    def circle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [c for c in map(circle_from, graph) if c]
    assert not circles, " ; ".join(" -> ".join(c) for c in circles)
