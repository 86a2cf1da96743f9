"""An optimized XLA program read as text: what `ssd_jax.tools.inspect` counts in it.

`parse_hlo` splits the printed module (`compiled.as_text()`) into computations of `Instr`s;
`runs` says how often one call runs each computation whose instructions launch kernels (the entry,
loop bodies as often as XLA's known trip count, branches); `analyse` counts the kernels, the
copies or transposes of a KV cache, the large temporaries, and three corrections to XLA's cost
analysis: `gather_excess` (the whole table it counts for a fused gather that reads rows),
`loop_bytes` (the runs of a loop body it counts once) and `custom_bytes` (the custom calls it
counts nothing for: the Pallas kernels, cuBLAS). Plain text work: no JAX.
"""
from __future__ import annotations

import dataclasses
import functools
import re

# HLO instructions that launch nothing: values, views and containers (a loop's or branch's body
# is counted on its own).
_NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
                "conditional", "call", "after-all", "opt-barrier", "partition-id", "replica-id",
                "add-dependency", "domain"}


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction of an HLO computation, as printed."""
    name: str
    op: str
    shape: str           # as printed: "bf16[1,1024,2,128]{3,2,1,0}" or a tuple "(f32[2], s32[])"
    attrs: str           # the rest of the line (operands, calls=, body=, ...)
    root: bool


def _shape_end(text: str, i: int) -> int:
    """Index just past the shape that starts at text[i] (a tuple's parentheses balanced)."""
    if text[i] != "(":
        return text.index(" ", i)
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    raise ValueError(f"unbalanced tuple shape in {text[i:i + 80]!r}")


_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s+(ROOT )?%?([\w.\-]+) = ")


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """Optimized HLO text -> ({computation name: its instructions}, the entry's name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        rest = line[m.end():]
        end = _shape_end(rest, 0)
        op_m = re.match(r"\s*([a-z][\w\-]*)\(", rest[end:])
        if op_m is None:
            continue
        comps[current].append(Instr(m.group(2), op_m.group(1), rest[:end],
                                    rest[end + op_m.end():], bool(m.group(1))))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _called(attrs: str, keys: tuple[str, ...]) -> list[str]:
    names = []
    for key in keys:
        for m in re.finditer(rf"\b{key}=\{{?([^}},]+(?:,\s*%[^}},]+)*)\}}?", attrs):
            names += [n.strip().lstrip("%") for n in m.group(1).split(",")]
    return names


def known_trips(ins: Instr) -> int | None:
    """A while loop's trip count where XLA knows it (`known_trip_count` in its backend config: a
    `lax.scan`, a `fori_loop` of static bounds), else None."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    return int(m.group(1)) if m else None


def runs(comps: dict[str, list[Instr]], entry: str, *, trips: bool = True) -> dict[str, int]:
    """{computation: how often one call runs it} for those whose instructions run as kernels: the
    entry once; a loop's body and condition as often as its known trip count, once where it is
    not known (a chunk's loop of rounds: one iteration) or with `trips=False` (as XLA's cost
    analysis counts them); each branch of a conditional once (not fusions' insides)."""
    times: dict[str, int] = {}

    def visit(name: str, n: int) -> None:
        if name not in comps:
            return
        times[name] = times.get(name, 0) + n
        for ins in comps[name]:
            if ins.op in ("while", "conditional", "call"):
                k = n * (known_trips(ins) or 1) if ins.op == "while" and trips else n
                for callee in _called(ins.attrs, ("body", "condition", "branch_computations",
                                                  "true_computation", "false_computation",
                                                  "to_apply")):
                    visit(callee, k)

    visit(entry, 1)
    return times


def executed(comps: dict[str, list[Instr]], entry: str) -> list[str]:
    """The computations whose instructions run as kernels (`runs`' keys): the entry and,
    transitively, the bodies, conditions and branches of its loops and conditionals."""
    return list(runs(comps, entry))


_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}


def arrays(shape: str) -> list[tuple[str, int]]:
    """(dtype, element count) of each array in a printed shape (one, or a tuple's)."""
    out = []
    for dt, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append((dt, n))
    return out


def nbytes(shape: str) -> int:
    """Bytes of the arrays in a printed shape."""
    return sum(_BYTES.get(dt, 4) * n for dt, n in arrays(shape))


def analyse(text: str, *, layers: int, cache_elems, small_weight_bytes: int) -> dict:
    """The counts `ssd_jax.tools.inspect` reports (its module docstring), from optimized HLO
    `text`: kernels (and by opcode, a fusion as its kind), results the size of a cache made by a
    copy, transpose or slice (a fusion's each, `_MOVES`; cache_elems: a layer's K or V cache in
    elements, or a tuple of such sizes), large non-output
    temporaries (a library call's scratch workspace not counted), `gather_excess`, `loop_bytes`
    and `custom_bytes`."""
    sizes = set(cache_elems) if isinstance(cache_elems, (tuple, list, set)) else {cache_elems}
    comps, entry = parse_hlo(text)
    fused_roots = {name: _root_ops(ins) for name, ins in comps.items()}
    outputs = set()
    for ins in comps[entry]:
        if ins.root:
            outputs |= set(re.findall(r"%([\w.\-]+)", ins.attrs.split(")")[0])) | {ins.name}
    kernels, ops, copies, large = 0, {}, 0, []
    times, once = runs(comps, entry), runs(comps, entry, trips=False)
    for c, n in times.items():
        for ins in comps[c]:
            if ins.op in _NOT_KERNELS:
                continue
            kernels += n
            kind = ins.op
            made_by = [ins.op] * len(arrays(ins.shape))  # the op making each result
            if ins.op == "fusion":
                m = re.search(r"kind=(k\w+)", ins.attrs)
                kind = f"fusion:{m.group(1) if m else '?'}"
                called = _called(ins.attrs, ("calls",))
                made_by = fused_roots.get(called[0], []) if called else []
            ops[kind] = ops.get(kind, 0) + n
            elems = [e for _, e in arrays(ins.shape)]
            cache_sized = bool(sizes.intersection(elems))
            moved = sum(1 for (_, e), op in zip(arrays(ins.shape), made_by)
                        if e in sizes and op in _MOVES)
            if moved:
                copies += n * moved
            elif cache_sized and ins.op in ("copy", "transpose"):
                copies += n
            elif (not cache_sized and c == entry and ins.name not in outputs
                  and sum(_results(ins).values()) >= small_weight_bytes):
                large.append(f"{ins.op} {ins.shape.split('{')[0]}")
    return dict(kernels=kernels, per_layer=kernels / max(layers, 1), kernel_ops=ops,
                cache_copies=copies, large_temporaries=large,
                gather_excess=_gather_excess(comps, entry),
                loop_bytes=_loop_bytes(comps, times, once),
                custom_bytes=_custom_bytes(comps, entry))


# Ops whose result, the size of a KV cache, is that cache moved whole (a copy, a transpose, a slice
# taken out of a larger buffer), where an in-place update writes only its rows.
_MOVES = ("copy", "transpose", "dynamic-slice", "slice")


def _root_ops(body: list[Instr]) -> list[str]:
    """The op that makes each result of a computation: its root's, or for a tuple root, each
    tuple operand's."""
    root = next((i for i in body if i.root), None)
    if root is None:
        return []
    if root.op != "tuple":
        return [root.op]
    by_name = {i.name: i.op for i in body}
    return [by_name.get(o, "?") for o in _operands(root)]


def _loop_bytes(comps: dict[str, list[Instr]], times: dict[str, int], once: dict[str, int]) -> int:
    """The bytes XLA's cost analysis leaves out of a loop of known trip count n, which it counts
    once: n - 1 more runs of its body and condition (`times` against `once`, `runs` with and
    without trip counts), each kernel's result and operands counted whole (an estimate that errs
    high: a fusion may read part of an operand)."""
    extra = 0
    for c, n in times.items():
        if n == once[c]:
            continue
        shapes = {i.name: i.shape for i in comps[c]}
        own = sum(nbytes(i.shape) + sum(nbytes(shapes.get(o, "")) for o in _operands(i))
                  for i in comps[c] if i.op not in _NOT_KERNELS)
        extra += (n - once[c]) * own
    return extra


def _operands(ins: Instr) -> list[str]:
    return re.findall(r"%([\w.\-]+)", ins.attrs.split(")")[0])


def _results(ins: Instr) -> dict[int, int]:
    """Bytes of each array `ins` results in, by tuple index, less a cuBLAS call's scratch
    workspace (the s8 array its tuple ends with): what the call leaves for others to read."""
    sizes = {k: e * _BYTES.get(t, 4) for k, (t, e) in enumerate(arrays(ins.shape))}
    if ins.op == "custom-call" and '"__cublas' in ins.attrs and len(sizes) > 1:
        last = max(sizes)
        if arrays(ins.shape)[last][0] == "s8":
            del sizes[last]
    return sizes


def _aliased(ins: Instr) -> set[int]:
    """The result indices of `ins` aliased to an operand (`output_to_operand_aliasing`; 0 for a
    single result)."""
    at = ins.attrs.find("output_to_operand_aliasing={")
    if at < 0:
        return set()
    pairs = re.findall(r"\{(\d*)\}:\s*\(\d+,", ins.attrs[at:].split(")}", 1)[0] + ")")
    return {int(k) if k else 0 for k in pairs}


def _summed_as_analysed(comps: dict[str, list[Instr]], entry: str, own) -> int:
    """`own(ins, body)` (a figure of instruction `ins` of computation `body`) summed over what
    `entry` runs, as XLA's cost analysis sums: a loop's body and condition once, the largest
    branch of a conditional."""
    @functools.lru_cache(maxsize=None)
    def run(name: str) -> int:
        body = comps.get(name, [])
        total = 0
        for ins in body:
            if ins.op in ("while", "call"):
                total += sum(run(c) for c in _called(ins.attrs, ("body", "condition", "to_apply")))
            elif ins.op == "conditional":
                total += max((run(c) for c in _called(ins.attrs, (
                    "branch_computations", "true_computation", "false_computation"))), default=0)
            else:
                total += own(ins, body)
        return total

    return run(entry)


def _custom_bytes(comps: dict[str, list[Instr]], entry: str) -> int:
    """Bytes the custom calls move, which XLA's cost analysis leaves out (it marks a custom call's
    bytes unknown): each call's operands read whole, and its results written whole but for its
    workspace and those aliased to an operand (a cache the Pallas attention updates in place, its
    read already counted). Summed as the analysis sums the rest (`_summed_as_analysed`; a loop's
    other runs are `loop_bytes`'): an estimate that errs high for a kernel that reads part of an
    operand (the attention reads the live prefix of a cache, counted whole)."""
    shapes_of: dict[int, dict[str, str]] = {}

    def own(ins: Instr, body: list[Instr]) -> int:
        if ins.op != "custom-call":
            return 0
        if id(body) not in shapes_of:
            shapes_of[id(body)] = {i.name: i.shape for i in body}
        shapes = shapes_of[id(body)]
        aliased = _aliased(ins)
        written = sum(b for k, b in _results(ins).items() if k not in aliased)
        # + 1: the analysis counted the call as -1 byte
        return written + sum(nbytes(shapes.get(o, "")) for o in _operands(ins)) + 1

    return _summed_as_analysed(comps, entry, own)


def gather_excess(text: str) -> int:
    """Bytes XLA's cost analysis counts beyond what the fused gathers of optimized HLO `text`
    read: a fusion parameter whose one use is a gather's table counts whole there, where the
    gather reads its result's bytes. Summed as the analysis sums (a loop body once, the largest
    branch of a conditional). `analyse` reports it too."""
    return _gather_excess(*parse_hlo(text))


def _gather_excess(comps: dict[str, list[Instr]], entry: str) -> int:
    def fused(name: str) -> int:
        body = comps.get(name, [])
        params = {i.name: i for i in body if i.op == "parameter"}
        uses: dict[str, int] = {}
        for i in body:
            for o in _operands(i):
                uses[o] = uses.get(o, 0) + 1
        excess = 0
        for i in body:
            table = _operands(i)[:1] if i.op == "gather" else []
            if table and table[0] in params and uses[table[0]] == 1:
                excess += max(0, nbytes(params[table[0]].shape) - nbytes(i.shape))
        return excess

    return _summed_as_analysed(comps, entry, lambda i, _: sum(
        fused(c) for c in _called(i.attrs, ("calls",))) if i.op == "fusion" else 0)


__all__ = ["Instr", "analyse", "arrays", "executed", "gather_excess", "known_trips", "nbytes",
           "parse_hlo", "runs"]
