"""Sharded matrix products Y = A B, A (m, k) and B (k, n), under named policies.

Each policy is a few lines of local math plus named collectives; every collective is a
``redistribute`` step, so the communication of a policy is exactly the redistribution of its
operands into the placements it computes on, and of its result out of them. Along one mesh
axis of p ranks (``axis``):

    duplicated     A, B replicated. Y = A B on every rank. No communication.
    inner          A sharded along k (Shard(1)), B along k (Shard(0)) with the same cuts, or
                   replicated (its piece is then sliced locally):
                   Y_i = A_i B_i is a pending sum (Partial), AllReduce -> Y.
                   (``out=Shard(0)``: ReduceScatter instead; ``out=Partial()``: none.)
    inner_gather   A sharded along k, B cut otherwise (along n, or other cuts of k):
                   AllGather A (and B) along k first, then Y = A B. No reduction.
    outer          A sharded along m (Shard(0)), B along k (Shard(0)): AllGather B, then
                   Y_i = A_i B is sharded by rows, AllGather Y -> Y. (``out=Shard(0)``: one.)
    full           two mesh axes (r, c), m, k and n all sharded: A {r: Shard(0), c: Shard(1)},
                   B {r: Shard(0), c: Shard(1)}. AllGather A along c (A_i: (m_i, k)),
                   AllGather B along r (B_j: (k, n_j)), Y_ij = A_i B_j: Y {r: Shard(0),
                   c: Shard(1)} - each rank a block of Y (SUMMA in one round).
    local          placements that already fit without communication on every axis: rows of
                   A (Y by rows), columns of B (Y by columns), a matched inner dimension
                   left Partial, replicas.

Backward, the same rules read backwards: dA = dY B^T and dB = A^T dY on the local pieces,
placed by the rule of each axis (a sharded inner dimension gives dA, dB sharded like A, B;
rows of A give dB as a Partial sum), then redistributed to the operands' own placements (a
Partial sum becomes a ReduceScatter or AllReduce). The gradient of an operand comes back in
that operand's placement, except that the gradient of a Partial operand is Replicate (every
addend gets the whole gradient).

16-bit operands are multiplied in float32 and rounded once, as GPU GEMMs accumulate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..comm.agreement import trusted
from .darray import DArray
from ..errors import HpcparError
from .piece_layout import attempt, given_key, normalize_placements, placements_text
from .placement import Partial, Placement, Replicate, Shard
from .splits import even_sizes

POLICIES = ("duplicated", "inner", "inner_gather", "outer", "full", "local")
PLACEMENT_OPTIONS = ("out", "da_placements", "db_placements")
R, P = Replicate(), Partial()


class PolicyError(HpcparError):
    """Operands whose placements fit no policy, or a policy that cannot run on them."""


@dataclass(frozen=True)
class MatmulCtx:
    """What the backward needs: the operands as multiplied, and the placements involved."""

    a: DArray                      # A as the local product read it
    b: DArray
    a_placements: tuple            # A's and B's own placements (the gradients' placements)
    b_placements: tuple
    y_placements: tuple            # Y as the local product made it
    policy: str


def _is(p, dim: int) -> bool:
    return isinstance(p, Shard) and p.dim == dim


def _whole(p, length: int, parts: int) -> bool:
    """Not a shard, or one whose elements each live on one rank: a unit replicated on
    several ranks would be summed twice by a Partial result or gradient."""
    return not isinstance(p, Shard) or p.partitions(length, parts)


def axis_rule(pa: Placement, pb: Placement, m: int, k: int, n: int, parts: int):
    """(Y, dA, dB) placements along one axis for the local product of pieces placed
    (pa, pb) of A (m, k) and B (k, n), or None when that pair needs communication first."""
    if not (_whole(pa, (m, k)[getattr(pa, "dim", 0)], parts)
            and _whole(pb, (k, n)[getattr(pb, "dim", 0)], parts)):
        return None
    if pa == R and pb == R:
        return R, R, R
    if _is(pa, 0) and pb == R:
        return Shard(0, pa.sizes, pa.unit), pa, P
    if pa == R and _is(pb, 1):
        return Shard(1, pb.sizes, pb.unit), P, pb
    if _is(pa, 1) and _is(pb, 0) and pa.bounds(k, parts) == pb.bounds(k, parts):
        return P, pa, pb
    if pa == P and pb == R:
        return P, R, P
    if pa == R and pb == P:
        return P, P, R
    return None


def _rules(a_pl, b_pl, a_shape, b_shape, sizes) -> list | None:
    (m, k), n = a_shape, b_shape[1]
    rules = [axis_rule(pa, pb, m, k, n, parts) for pa, pb, parts in zip(a_pl, b_pl, sizes)]
    return None if any(r is None for r in rules) else rules


def choose(a: DArray, b: DArray) -> tuple[str, tuple[int, ...]]:
    """The policy the operands' placements ask for, and the mesh axes it acts on."""
    mesh = a.mesh
    pairs = list(zip(a.placements, b.placements))
    if _rules(a.placements, b.placements, a.shape, b.shape, mesh.sizes) is not None:
        if all(pa == R and pb == R for pa, pb in pairs):
            return "duplicated", ()
        inner = tuple(i for i, (pa, pb) in enumerate(pairs) if _is(pa, 1) and _is(pb, 0))
        if len(inner) > 1:
            raise PolicyError(
                f"matmul: A {a.placement_text()} and B {b.placement_text()} cut k over mesh "
                f"axes {[mesh.axis_names[i] for i in inner]}; the products sum over one axis "
                f"at a time: redistribute k onto one axis, or pass policy= and axis=")
        return ("inner", inner) if inner else ("local", ())
    (m, k), n = a.shape, b.shape[1]
    busy = [i for i, (pa, pb) in enumerate(pairs)
            if axis_rule(pa, pb, m, k, n, mesh.sizes[i]) is None]
    if len(busy) == 2:
        r, c = busy
        if _is(a.placements[r], 0) and _is(a.placements[c], 1) \
                and _is(b.placements[r], 0) and _is(b.placements[c], 1):
            return "full", (r, c)
    if len(busy) == 1:
        i = busy[0]
        pa, pb = pairs[i]
        if _is(pa, 1):
            # B whole on every rank: slice it like A and sum partial products (1/p of the
            # flops, as DTensor does), rather than gather A and multiply all of it
            return ("inner" if pb == R else "inner_gather"), (i,)
        if _is(pa, 0) and _is(pb, 0):
            return "outer", (i,)
    raise PolicyError(
        f"matmul: A {a.placement_text()} and B {b.placement_text()} fit none of the policies "
        f"({', '.join(POLICIES)}); pass policy= (the operands are then redistributed to it) "
        f"or redistribute an operand first")


def _axes_for(policy: str, a: DArray, b: DArray, axis) -> tuple[int, ...]:
    mesh = a.mesh
    if axis is not None:
        names = (axis,) if isinstance(axis, str) else tuple(axis)
        return tuple(mesh.axis_index(n) for n in names)
    if policy in ("duplicated", "local"):
        return ()
    want = 2 if policy == "full" else 1
    if len(mesh.sizes) == want:
        return tuple(range(want))
    sharded = [i for i in range(len(mesh.sizes))
               if isinstance(a.placements[i], Shard) or isinstance(b.placements[i], Shard)]
    if len(sharded) == want:
        return tuple(sharded)
    raise PolicyError(f"matmul policy {policy!r} on a mesh of axes {list(mesh.axis_names)}: "
                      f"say which axis it acts on (axis=)")


def _inputs(policy: str, a: DArray, b: DArray, axes: tuple[int, ...]):
    """The placements A and B are multiplied in under ``policy``."""
    mesh = a.mesh
    (m, k), n = a.shape, b.shape[1]
    a_in, b_in = list(a.placements), list(b.placements)
    for i, parts in enumerate(mesh.sizes):    # axes the policy leaves alone: as they are if
        if i not in axes and axis_rule(a_in[i], b_in[i], m, k, n, parts) is None:
            a_in[i], b_in[i] = R, R           # the local rules take them, else replicated
    if policy == "full":
        if len(axes) != 2:
            raise PolicyError("matmul policy 'full' acts on two mesh axes (axis=(rows, cols))")
        r, c = axes
        a_in[r], a_in[c] = _shard_like(a.placements[r], 0, m, mesh.sizes[r]), R  # AllGather A
        b_in[r], b_in[c] = R, _shard_like(b.placements[c], 1, n, mesh.sizes[c])  # AllGather B
        return a_in, b_in
    if policy == "duplicated":
        return [R] * len(mesh.sizes), [R] * len(mesh.sizes)
    if policy != "local" and len(axes) != 1:
        raise PolicyError(f"matmul policy {policy!r} acts on one mesh axis, got {len(axes)}")
    for i in axes if policy != "local" else ():
        pa, pb, parts = a.placements[i], b.placements[i], mesh.sizes[i]
        if policy == "inner":
            cut = pa if _is(pa, 1) and _whole(pa, k, parts) else (
                Shard(1, pb.sizes, pb.unit) if _is(pb, 0) and _whole(pb, k, parts)
                else _cut(1, k, parts))
            a_in[i], b_in[i] = cut, Shard(0, cut.sizes, cut.unit)
        elif policy == "inner_gather":
            a_in[i] = R
            b_in[i] = pb if _is(pb, 1) and _whole(pb, n, parts) else R
        elif policy == "outer":
            a_in[i], b_in[i] = _shard_like(pa, 0, m, parts), R
    return a_in, b_in


def _shard_like(p, dim: int, length: int, parts: int) -> Shard:
    return p if _is(p, dim) and _whole(p, length, parts) else _cut(dim, length, parts)


def _cut(dim: int, length: int, parts: int) -> Shard:
    """A policy's own cut of an operand: even, or ``numpy.array_split``'s when uneven."""
    return Shard(dim) if length % parts == 0 else Shard(dim, tuple(even_sizes(length, parts)))


def _default_out(policy: str, y_pl: list) -> list:
    if policy in ("inner", "inner_gather", "outer", "duplicated"):
        return [R] * len(y_pl)
    return y_pl


def local_product(xp, a, b):
    """A B of local arrays; 16-bit floats multiplied in float32, rounded once."""
    if a.dtype.itemsize < 4 and a.dtype.kind == "f" or a.dtype.kind == "V":
        return xp.matmul(a.astype(xp.float32), b.astype(xp.float32)).astype(a.dtype)
    return xp.matmul(a, b)


def _check(a: DArray, b: DArray) -> None:
    if a.mesh is not b.mesh:
        raise PolicyError("matmul: A and B live on different meshes; build both on one Mesh")
    if a.ndim != 2 or b.ndim != 2:
        raise PolicyError(f"matmul takes 2-D operands, got A {a.shape} and B {b.shape}; "
                          f"reshape to (rows, k) first")
    if a.shape[1] != b.shape[0]:
        raise PolicyError(f"matmul: A {a.shape} and B {b.shape} do not share the inner "
                          f"dimension ({a.shape[1]} != {b.shape[0]})")
    if a.dtype != b.dtype:
        raise PolicyError(f"matmul: A is {a.dtype} and B is {b.dtype}; cast one first")


@dataclass(frozen=True)
class _Product:
    """How one product runs: the policy, the placements A and B are multiplied in, Y's
    placements as the local product makes them, and the placements Y is returned in."""

    policy: str
    a_in: tuple
    b_in: tuple
    y_local: tuple
    y_out: tuple


_PRODUCTS: dict = {}                # pure: one per operands' layout and options


def _product(a: DArray, b: DArray, policy: str | None, axis, out) -> _Product:
    _check(a, b)
    mesh = a.mesh
    try:
        key = (a.shape, a.placements, b.shape, b.placements, mesh.sizes, mesh.axis_names,
               policy, axis, None if out is None else normalize_placements(mesh, out, 2))
        found = _PRODUCTS.get(key)
    except TypeError:                               # an unhashable option: not remembered
        key, found = None, None
    if found is None:
        found = _make_product(a, b, policy, axis, out)
        if key is not None:
            if len(_PRODUCTS) > 4096:
                _PRODUCTS.clear()
            _PRODUCTS[key] = found
    return found


def _make_product(a: DArray, b: DArray, policy: str | None, axis, out) -> _Product:
    mesh = a.mesh
    if policy is None:
        policy, axes = choose(a, b)
        if axis is not None:
            axes = _axes_for(policy, a, b, axis)
    else:
        if policy not in POLICIES:
            raise PolicyError(f"matmul policy {policy!r} is not one of {', '.join(POLICIES)}")
        axes = _axes_for(policy, a, b, axis)
    a_in, b_in = _inputs(policy, a, b, axes)
    rules = _rules(a_in, b_in, a.shape, b.shape, mesh.sizes)
    if rules is None:
        raise PolicyError(f"matmul policy {policy!r} cannot multiply A {a.placement_text()} "
                          f"by B {b.placement_text()}")
    y_local = tuple(r[0] for r in rules)
    y_out = normalize_placements(mesh, _default_out(policy, list(y_local)) if out is None
                                 else out, 2)
    return _Product(policy, tuple(a_in), tuple(b_in), y_local, y_out)


def _checked(what: str, operands: dict[str, DArray], make, **options):
    """``make()``, what this rank makes of ``operands`` and ``options`` (matmul's ``_Product``;
    or its bad input), once every rank is found to pass the same operands (shapes, dtypes,
    placements, meshes) and options; bad input on one rank is raised on every rank. Remembered
    on the mesh, so that a product repeated in a loop costs a lookup and the check's small
    all-reduce."""
    mesh = next(iter(operands.values())).mesh
    key = _key(what, mesh, operands, options)
    known = mesh.programs.get(key) if key is not None else None
    if known is not None:
        made, check = known
        if mesh.checking:
            check()
        return made
    made, error = attempt(None, make)
    if mesh.checking:
        mesh.agree(what, _fields(operands, options), error)
    elif error is not None:
        raise error
    if key is not None:
        mesh.remember(key, (made, mesh.check_for(what, _fields(operands, options))))
    return made


def _key(what: str, mesh, operands: dict[str, DArray], options: dict):
    """What the check's fields hold, as a key; None where it cannot be one (an unhashable
    option, an operand on another mesh)."""
    if any(x.mesh is not mesh for x in operands.values()):
        return None
    key = (what, *((x.shape, x.local.dtype, x.placements) for x in operands.values()),
           *((name, given_key(v)) for name, v in options.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _fields(operands: dict[str, DArray], options: dict) -> list:
    fields = [(f"{name}'s {label}", v) for name, x in operands.items()
              for label, v in x.agreement_fields() + [("mesh", x.mesh.fingerprint)]]
    return fields + [(name, placements_text(v) if name in PLACEMENT_OPTIONS and v is not None
                      else v) for name, v in options.items()]


def matmul_forward(a: DArray, b: DArray, policy: str | None = None, axis=None,
                   out=None) -> tuple[DArray, MatmulCtx]:
    """Y = A B under ``policy`` (default: the one the placements ask for, ``choose``),
    placed as ``out`` (default: the policy's), and the ctx ``matmul_backward`` needs."""
    product = _checked("matmul", {"A": a, "B": b},
                       lambda: _product(a, b, policy, axis, out),
                       policy=policy, axis=axis, out=out)
    with trusted():
        return _matmul_forward(a, b, product)


def _matmul_forward(a: DArray, b: DArray, product: _Product) -> tuple[DArray, MatmulCtx]:
    a2, b2 = _moved(a, product.a_in), _moved(b, product.b_in)
    y = DArray.unchecked(local_product(a.mesh.backend.xp, a2.local, b2.local),
                         (a.shape[0], b.shape[1]), a.mesh, product.y_local)
    ctx = MatmulCtx(a2, b2, a.placements, b.placements, product.y_local, product.policy)
    return _moved(y, product.y_out), ctx


def _moved(x: DArray, placements: tuple) -> DArray:
    """``x`` redistributed inside a checked call: itself where it is placed so already."""
    return x if placements == x.placements else x.redistribute(placements)


def matmul(a: DArray, b: DArray, policy: str | None = None, axis=None, out=None) -> DArray:
    """Y = A B (see the module docstring for the policies); forward only."""
    return matmul_forward(a, b, policy, axis, out)[0]


def gradient_placements(placements: Sequence[Placement]) -> list[Placement]:
    """Where the gradient of an array placed so lives: the same, a Partial sum's is whole."""
    return [R if isinstance(p, Partial) else p for p in placements]


def matmul_backward(dy: DArray, ctx: MatmulCtx, da_placements=None,
                    db_placements=None) -> tuple[DArray, DArray]:
    """(dA, dB) from dY (any placement): dA = dY B^T, dB = A^T dY, each in its operand's
    placement (``gradient_placements``) unless ``da_placements`` / ``db_placements`` say
    otherwise."""
    _checked("matmul_backward", {"dY": dy, "A": ctx.a, "B": ctx.b}, lambda: None,
             policy=ctx.policy, da_placements=da_placements, db_placements=db_placements)
    with trusted():
        return _matmul_backward(dy, ctx, da_placements, db_placements)


def _matmul_backward(dy: DArray, ctx: MatmulCtx, da_placements, db_placements):
    mesh, xp = ctx.a.mesh, ctx.a.mesh.backend.xp
    a, b = ctx.a, ctx.b
    dy = dy.redistribute(gradient_placements(ctx.y_placements))
    rules = _rules(a.placements, b.placements, a.shape, b.shape, mesh.sizes)
    da = DArray.unchecked(local_product(xp, dy.local, b.local.T), a.shape, mesh,
                          tuple(r[1] for r in rules))
    db = DArray.unchecked(local_product(xp, a.local.T, dy.local), b.shape, mesh,
                          tuple(r[2] for r in rules))
    own = (gradient_placements(ctx.a_placements), gradient_placements(ctx.b_placements))
    return tuple(grad.redistribute(own[i] if given is None else given)   # {}: all replicated
                 for i, (grad, given) in enumerate(((da, da_placements), (db, db_placements))))


def matmul_communication(a: DArray, b: DArray, policy: str | None = None, axis=None,
                         out=None) -> list[str]:
    """The collectives ``matmul`` would run, as text (pure: nothing is sent)."""
    from .redistribute import COMMUNICATING
    from .redistribute import redistribution_steps as steps_of
    p, sizes, names = _product(a, b, policy, axis, out), a.mesh.sizes, a.mesh.axis_names
    steps = [("A", steps_of(a.shape, sizes, a.placements, p.a_in)),
             ("B", steps_of(b.shape, sizes, b.placements, p.b_in)),
             ("Y", steps_of((a.shape[0], b.shape[1]), sizes, p.y_local, p.y_out))]
    return [f"{what}: {s.text(names)}" for what, part in steps for s in part
            if s.op in COMMUNICATING]
