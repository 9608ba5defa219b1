"""The output shapes an op's rule makes from its input shapes and attributes (issue 13).

:func:`expected_output_shapes` answers, per output of a rule's forward mode, the global
shape the op produces, so that :meth:`spmdkit.program.ir.Program.validate` refuses a
program whose declared output shape contradicts its op. Each answer is a tuple with, per
axis, the size (an int) or ``None`` where the size is not fixed by the shapes and
attributes the rule sees (it depends on the data, or on an attribute the rule does not
take); a whole output is ``None`` where nothing is checked (its rank is still checked
against the rule's answer by ``validate``). The table is keyed by the rule's Paddle
function (``Rule.forward.function_name``: every rule of a family shares its shape
semantics), with a few per-rule entries; grad rules are derived from the declarations:
each grad output has the shape of the forward input it is the gradient of
(:func:`_grad_sources`). :data:`UNCHECKED` lists, with the reason, every output whose size
is not fixed (data-dependent sizes: nonzero, unique, MoE dispatch).

Shape semantics follow Paddle 3.3.1's InferMeta (paddle/phi/infermeta) as the rules and the
numpy references (spmdkit.sim) implement them; where a rule accepts more than one form
(layer_norm's statistics as ``x.shape[:begin]`` or flattened to 1-D) the rule's output
rank picks the form. Any doubt answers ``None``: a valid program is never refused.

Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

Shape = tuple[int | None, ...]
#: One output's expected shape: None (unchecked), a Shape, or a list of them (a vector output).
Expect = Union[None, Shape, list[Shape | None]]


class _Unknown(Exception):
    """The shape is not fixed by what the function sees: answer None."""


class Args:
    """The op's forward arguments by parameter name: tensors as shapes (tuples of ints), an
    absent optional as None, a vector as a list; attributes as the rule coerces them.
    ``ndims``: the rule's output ranks (None for an output it does not make)."""

    def __init__(self, values: Mapping[str, Any], tensor_params: Sequence[str], ndims: Sequence[Any]) -> None:
        self.values = values
        self.tensor_params = list(tensor_params)
        self.ndims = list(ndims)

    def s(self, name: str) -> tuple[int, ...]:
        v = self.values.get(name)
        if not isinstance(v, tuple):
            raise _Unknown
        return v

    def opt(self, name: str) -> tuple[int, ...] | None:
        v = self.values.get(name)
        return v if isinstance(v, tuple) else None

    def vec(self, name: str) -> list[tuple[int, ...] | None]:
        v = self.values.get(name)
        if not isinstance(v, list):
            raise _Unknown
        return v

    def a(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def first(self) -> tuple[int, ...]:
        return self.s(self.tensor_params[0])

    def nd(self, i: int) -> int | None:
        return self.ndims[i] if i < len(self.ndims) else None


ShapeFn = Callable[[Args], Sequence[Expect]]


# -- helpers ----------------------------------------------------------------------------------


def _axis(ax: Any, nd: int) -> int:
    if isinstance(ax, (list, tuple)):
        if len(ax) != 1:
            raise _Unknown
        ax = ax[0]
    if not isinstance(ax, int) or isinstance(ax, bool) or not -max(nd, 1) <= ax < max(nd, 1):
        raise _Unknown
    return ax % nd if nd else 0



def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    """Numpy broadcasting of shapes (``_Unknown`` where they do not broadcast)."""
    nd = max((len(s) for s in shapes), default=0)
    out: list[int] = []
    for i in range(nd):
        size = 1
        for s in shapes:
            k = len(s) - nd + i
            if k < 0:
                continue
            v = s[k]
            if v == 1:
                continue
            if size not in (1, v):
                raise _Unknown
            size = v
        out.append(size)
    return tuple(out)


def _same(*_: Any) -> ShapeFn:
    """Every output has the shape of the first tensor input."""
    return lambda a: [a.first() for _ in range(max(len(a.ndims), 1))]


def _reduce(s: tuple[int, ...], axes: Any, keep: bool, reduce_all: bool = False) -> tuple[int, ...]:
    nd = len(s)
    if isinstance(axes, int) and not isinstance(axes, bool):
        axes = (axes,)
    axes = tuple(axes or ())
    if reduce_all or not axes or nd == 0:
        red = set(range(nd))
    else:
        red = set()
        for ax in axes:
            if not isinstance(ax, int) or not -nd <= ax < nd:
                raise _Unknown
            red.add(ax % nd)
    if keep:
        return tuple(1 if i in red else v for i, v in enumerate(s))
    return tuple(v for i, v in enumerate(s) if i not in red)


# -- forward families -------------------------------------------------------------------------


def _binary(a: Args) -> list[Expect]:
    return [broadcast(a.s("x"), a.s("y"))]


def _where(a: Args) -> list[Expect]:
    return [broadcast(a.s("condition"), a.s("x"), a.s("y"))]


def _add_n(a: Args) -> list[Expect]:
    xs = [s for s in a.vec("input") if s is not None]
    if not xs:
        raise _Unknown
    return [broadcast(*xs)]


def _swiglu(a: Args) -> list[Expect]:
    x = a.s("x")
    y = a.opt("y")
    if y is not None:
        return [broadcast(x, y)]
    if not x or x[-1] % 2:
        raise _Unknown
    return [(*x[:-1], x[-1] // 2)]


def _reduction(a: Args) -> list[Expect]:
    keep = a.a("keep_dim", a.a("keepdims", False))
    return [_reduce(a.s("x"), a.a("axis", ()), bool(keep), bool(a.a("reduce_all", False)))]


def _over_axis_or_all(flag: str) -> Callable[[Args], list[Expect]]:
    """argmin / argmax (``flatten``) and p_norm (``asvector``): over ``axis``, or over every axis
    where ``flag`` is set."""

    def expect(a: Args) -> list[Expect]:
        x = a.s("x")
        keep = bool(a.a("keepdims", False))
        if a.a(flag, False):
            return [(1,) * len(x) if keep else ()]
        return [_reduce(x, (a.a("axis", -1),), keep)]

    return expect


_argminmax = _over_axis_or_all("flatten")
_p_norm = _over_axis_or_all("asvector")


def _scalar(a: Args) -> list[Expect]:
    return [()]


def _cumsum(a: Args) -> list[Expect]:
    x = a.s("x")
    return [(math.prod(x),) if a.a("flatten", False) else x]


def _matmul(a: Args) -> list[Expect]:
    return [_matmul_shape(a.s("x"), a.s("y"), bool(a.a("trans_x", False)), bool(a.a("trans_y", False)))]


def _matmul_shape(x: tuple[int, ...], y: tuple[int, ...], tx: bool, ty: bool) -> tuple[int, ...]:
    if not x or not y:
        raise _Unknown
    xs, ys = list(x), list(y)
    x1, y1 = len(xs) == 1, len(ys) == 1
    if x1:
        xs = [1, xs[0]]
    elif tx:
        xs[-1], xs[-2] = xs[-2], xs[-1]
    if y1:
        ys = [ys[0], 1]
    elif ty:
        ys[-1], ys[-2] = ys[-2], ys[-1]
    batch = broadcast(xs[:-2], ys[:-2])
    out = list(batch) + ([] if x1 else [xs[-2]]) + ([] if y1 else [ys[-1]])
    return tuple(out)


def _bmm(a: Args) -> list[Expect]:
    x, y = a.s("x"), a.s("y")
    if len(x) != 3 or len(y) != 3:
        raise _Unknown
    return [(x[0], x[1], y[2])]


def _linear_v2(a: Args) -> list[Expect]:
    x, w = a.s("input"), a.s("weight")
    if not x or len(w) != 2:
        raise _Unknown
    n = w[0] if a.a("transpose_weight", False) else w[1]
    return [(*x[:-1], n), None]


def _gemm(a: Args) -> list[Expect]:
    x, y = a.s("x"), a.s("y")
    if len(x) < 2 or len(y) != 2:
        raise _Unknown
    m = x[:-2] + ((x[-1],) if a.a("trans_x", False) else (x[-2],))
    n = y[0] if a.a("trans_y", False) else y[1]
    return [(*m, n), None]


def _einsum(a: Args) -> list[Expect]:
    """numpy / Paddle einsum: letters name axes (size-1 axes broadcast), ``...`` the broadcast
    of the operands' unnamed axes; an implicit output is ``...`` then the letters used once,
    sorted."""
    eq = a.a("equation")
    xs = a.vec("inputs")
    if not isinstance(eq, str) or any(s is None for s in xs):
        raise _Unknown
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(xs):
        raise _Unknown
    size: dict[str, int] = {}
    count: dict[str, int] = {}
    ell: list[tuple[int, ...]] = []
    for t, shape in zip(terms, xs):
        assert shape is not None
        if t.count("...") > 1 or ("." in t.replace("...", "")):
            raise _Unknown
        head, dots, tail = t.partition("...")
        n_ell = len(shape) - len(head) - len(tail)
        if n_ell < 0 or (n_ell and not dots):
            raise _Unknown
        named = list(zip(head, shape[:len(head)])) + list(zip(tail, shape[len(shape) - len(tail):]))
        if dots:
            ell.append(tuple(shape[len(head):len(head) + n_ell]))
        for ch, v in named:
            if not ch.isalpha():
                raise _Unknown
            count[ch] = count.get(ch, 0) + 1
            if v != 1:
                if size.get(ch, 1) not in (1, v):
                    raise _Unknown
                size[ch] = v
            else:
                size.setdefault(ch, 1)
    dims = broadcast(*ell) if ell else ()
    out = rhs if arrow else ("..." if ell else "") + "".join(sorted(ch for ch, n in count.items() if n == 1))
    if out.count("...") > 1 or "." in out.replace("...", ""):
        raise _Unknown
    head, dots, tail = out.partition("...")
    if any(ch not in size for ch in head + tail):
        raise _Unknown
    return [tuple(size[ch] for ch in head) + (dims if dots else ()) + tuple(size[ch] for ch in tail)]


def _concat(a: Args) -> list[Expect]:
    xs = [s for s in a.vec("x") if s is not None]
    if not xs:
        raise _Unknown
    nd = len(xs[0])
    ax = _axis(a.a("axis", 0), nd)
    if any(len(s) != nd for s in xs):
        raise _Unknown
    out = list(xs[0])
    out[ax] = sum(s[ax] for s in xs)
    return [tuple(out)]


def _stack(a: Args) -> list[Expect]:
    xs = [s for s in a.vec("x") if s is not None]
    if not xs:
        raise _Unknown
    s = broadcast(*xs) if len({len(x) for x in xs}) == 1 else None
    if s is None or any(x != s for x in xs):
        raise _Unknown
    ax = _axis(a.a("axis", 0), len(s) + 1)
    return [(*s[:ax], len(xs), *s[ax:])]


def _split(a: Args) -> list[Expect]:
    x = a.s("x")
    ax = _axis(a.a("axis", 0), len(x))
    secs = list(a.a("sections", ()))
    if secs.count(-1) > 1:
        raise _Unknown
    if -1 in secs:
        secs[secs.index(-1)] = x[ax] - sum(v for v in secs if v != -1)
    return [[(*x[:ax], v, *x[ax + 1:]) for v in secs]]


def _split_with_num(a: Args) -> list[Expect]:
    x = a.s("x")
    ax = _axis(a.a("axis", 0), len(x))
    num = a.a("num")
    if not isinstance(num, int) or num <= 0 or x[ax] % num:
        raise _Unknown
    return [[(*x[:ax], x[ax] // num, *x[ax + 1:]) for _ in range(num)]]


def _unbind(a: Args) -> list[Expect]:
    x = a.s("x")
    ax = _axis(a.a("axis", 0), len(x))
    return [[x[:ax] + x[ax + 1:] for _ in range(x[ax])]]


def _transpose(a: Args) -> list[Expect]:
    x = a.s("x")
    perm = a.a("perm")
    if len(perm) != len(x):
        raise _Unknown
    return [tuple(x[p % len(x)] for p in perm)]


def _reshape(a: Args) -> list[Expect]:
    return [_reshape_shape(a.s("x"), a.a("shape"))]


def _reshape_shape(x: tuple[int, ...], shape: Any) -> tuple[int, ...]:
    out: list[int] = []
    infer = -1
    for i, v in enumerate(shape):
        if v == 0:
            if i >= len(x):
                raise _Unknown
            out.append(x[i])
        elif v == -1:
            if infer >= 0:
                raise _Unknown
            infer = i
            out.append(-1)
        elif v > 0:
            out.append(v)
        else:
            raise _Unknown
    if infer >= 0:
        known = math.prod([v for v in out if v != -1])
        if known == 0:
            raise _Unknown
        out[infer] = math.prod(x) // known
    return tuple(out)


def _flatten(a: Args) -> list[Expect]:
    x = a.s("x")
    if not x:
        return [(1,)]
    start, stop = _axis(a.a("start_axis"), len(x)), _axis(a.a("stop_axis"), len(x))
    if start > stop:
        raise _Unknown
    return [(*x[:start], math.prod(x[start:stop + 1]), *x[stop + 1:])]


def _squeeze(a: Args) -> list[Expect]:
    x = a.s("x")
    axes = a.a("axis") or ()
    if not axes:
        return [tuple(v for v in x if v != 1)]
    drop = {_axis(ax, len(x)) for ax in axes}
    return [tuple(v for i, v in enumerate(x) if not (i in drop and v == 1))]


def _unsqueeze(a: Args) -> list[Expect]:
    out = list(a.s("x"))
    for ax in a.a("axis") or ():
        nd = len(out) + 1
        if not -nd <= ax < nd:
            raise _Unknown
        out.insert(ax % nd, 1)
    return [tuple(out)]


def _expand(a: Args) -> list[Expect]:
    x = a.s("x")
    shape = list(a.a("shape"))
    if len(shape) < len(x):
        raise _Unknown
    off = len(shape) - len(x)
    out = []
    for i, v in enumerate(shape):
        if v == -1:
            if i < off:
                raise _Unknown
            v = x[i - off]
        out.append(v)
    return [tuple(out)]


def _expand_as(a: Args) -> list[Expect]:
    y = a.opt("y")
    t = tuple(a.a("target_shape") or ())
    if t:
        return [t]
    if y is None:
        raise _Unknown
    return [y]


def _tile(a: Args) -> list[Expect]:
    x = a.s("x")
    rep = list(a.a("repeat_times"))
    nd = max(len(x), len(rep))
    xs = (1,) * (nd - len(x)) + x
    rs = [1] * (nd - len(rep)) + rep
    return [tuple(u * v for u, v in zip(xs, rs))]


def _slice_size(size: int, start: int, end: int, step: int = 1) -> int:
    return len(range(*slice(start, end, step).indices(size)))


def _slice(a: Args) -> list[Expect]:
    x = a.s("input")
    out: list[int | None] = list(x)
    for ax, st, en in zip(a.a("axes"), a.a("starts"), a.a("ends")):
        i = _axis(ax, len(x))
        out[i] = _slice_size(x[i], st, en)
    dec = {_axis(d, len(x)) for d in a.a("decrease_axis") or ()}
    return [tuple(v for i, v in enumerate(out) if i not in dec)]


def _strided_slice(a: Args) -> list[Expect]:
    x = a.s("input")
    out: list[int | None] = list(x)
    for ax, st, en, sd in zip(a.a("axes"), a.a("starts"), a.a("ends"), a.a("strides")):
        i = _axis(ax, len(x))
        if sd == 0:
            raise _Unknown
        out[i] = _slice_size(x[i], st, en, sd)
    return [tuple(out)]


def _padded(x: tuple[int, ...], paddings: Any, sign: int) -> tuple[int, ...]:
    """``x`` with Paddle's per-axis (before, after) ``paddings`` added (``sign`` 1) or taken off (-1)."""
    p = list(paddings)
    if len(p) != 2 * len(x):
        raise _Unknown
    return tuple(v + sign * (p[2 * i] + p[2 * i + 1]) for i, v in enumerate(x))


def _pad(a: Args) -> list[Expect]:
    return [_padded(a.s("x"), a.a("paddings"), 1)]


def _index_len(idx: tuple[int, ...]) -> tuple[int, ...]:
    """A gather index as Paddle reads it: 0-D, 1-D, or [N, 1] as [N]."""
    if len(idx) == 2 and idx[1] == 1:
        return (idx[0],)
    if len(idx) > 1:
        raise _Unknown
    return idx


def _gather(a: Args) -> list[Expect]:
    x, idx = a.s("x"), _index_len(a.s("index"))
    ax = _axis(a.a("axis", 0), len(x))
    return [x[:ax] + idx + x[ax + 1:]]


def _index_select(a: Args) -> list[Expect]:
    x, idx = a.s("x"), a.s("index")
    ax = _axis(a.a("axis", 0), len(x))
    if len(idx) != 1:
        raise _Unknown
    return [x[:ax] + idx + x[ax + 1:]]


def _gather_nd(a: Args) -> list[Expect]:
    x, idx = a.s("x"), a.s("index")
    if not idx or idx[-1] > len(x):
        raise _Unknown
    return [idx[:-1] + x[idx[-1]:]]


def _take_along_axis(a: Args) -> list[Expect]:
    return [a.s("index")]


def _embedding(a: Args) -> list[Expect]:
    w = a.s("weight")
    if len(w) != 2:
        raise _Unknown
    return [(*a.s("x"), w[1])]


def _one_hot(a: Args) -> list[Expect]:
    n = a.a("num_classes")
    if not isinstance(n, int) or n < 0:
        raise _Unknown
    return [(*a.s("x"), n)]


def _topk(a: Args) -> list[Expect]:
    x = a.s("x")
    if not x:
        return [(), ()]
    ax = _axis(a.a("axis", -1), len(x))
    k = a.a("k", 1)
    out = (*x[:ax], k, *x[ax + 1:])
    return [out, out]


def _nonzero(a: Args) -> list[Expect]:
    return [(None, len(a.s("x")))]


def _unique(a: Args) -> list[Expect]:
    """out, indices and counts have as many entries as distinct values (data): only their
    other axes are checked; inverse has one entry per element of x (per slice along axis)."""
    x = a.s("x")
    axes = a.a("axis") or ()
    if len(axes) > 1:
        raise _Unknown
    if axes:
        ax = _axis(axes[0], len(x))
        out: Shape = (*x[:ax], None, *x[ax + 1:])
        inverse: Shape = (x[ax],)
    else:
        out, inverse = (None,), (math.prod(x),)
    shapes: list[Shape] = [out, (None,), inverse, (None,)]
    return [s if a.nd(i) == len(s) else None for i, s in enumerate(shapes)]


def _stats(x: tuple[int, ...], keep: int, nd: int | None) -> Shape:
    """A normalisation statistic over ``x.shape[:keep]``: that shape, or flattened to 1-D
    (the rule's output rank says which)."""
    lead = x[:keep]
    if nd == len(lead):
        return lead
    if nd == 1:
        return (math.prod(lead),)
    if nd == 0 and math.prod(lead) == 1:
        return ()
    raise _Unknown


def _layer_norm(a: Args) -> list[Expect]:
    x = a.s("x")
    b = _axis(a.a("begin_norm_axis", 1), len(x)) if x else 0
    return [x, _opt_stats(x, b, a.nd(1)), _opt_stats(x, b, a.nd(2))]


def _opt_stats(x: tuple[int, ...], keep: int, nd: int | None) -> Expect:
    try:
        return _stats(x, keep, nd)
    except _Unknown:
        return None


def _rms_norm(a: Args) -> list[Expect]:
    x = a.s("x")
    if not x:
        raise _Unknown
    return [x, _opt_stats(x, len(x) - 1, a.nd(1))]


def _batch_norm(a: Args) -> list[Expect]:
    """out like x; the running and saved statistics like the running mean ([C], whichever
    axis of x the channels are); reserve_space is kernel workspace."""
    x, mean = a.s("x"), a.opt("mean")
    return [x, mean, a.opt("variance"), mean, mean, None]


def _group_norm(a: Args) -> list[Expect]:
    """y like x; mean and variance are [N, groups] and the rule takes no groups."""
    x = a.s("x")
    return [x, (x[0], None) if x else None, (x[0], None) if x else None]


def _instance_norm(a: Args) -> list[Expect]:
    """y like x; saved_mean and saved_variance are [N * C] (InstanceNormInferMeta)."""
    x = a.s("x")
    stat = (x[0] * x[1],) if len(x) >= 2 else None
    return [x, stat, stat]


def _cross_entropy(a: Args) -> list[Expect]:
    x = a.s("x")
    if not x:
        raise _Unknown
    ax = _axis(a.a("axis", -1), len(x))
    return [x, (*x[:ax], 1, *x[ax + 1:])]


def _c_softmax(a: Args) -> list[Expect]:
    x = a.s("x")
    if not x:
        raise _Unknown
    return [x, (*x[:-1], 1)]


def _c_softmax_multi_label(a: Args) -> list[Expect]:
    x, label = a.s("x"), a.s("label")
    if not label:
        raise _Unknown
    return [x, (*label[:-1], 1) if a.a("sum_multi_label_loss", True) else label]


def _flash_attention(a: Args) -> list[Expect]:
    """q [B, Sq, H, D], v [B, Sk, Hk, Dv]: out [B, Sq, H, Dv]; softmax [B, H, Sq', Sk'] and
    softmax_lse [B, H, Sq'] (the kernel may round the sequence axes: not checked); seed_offset [2]."""
    q, v = a.s("q"), a.s("v")
    if len(q) != 4 or not v:
        raise _Unknown
    softmax: Expect = (q[0], q[2], None, None) if a.nd(1) == 4 else None
    lse: Expect = (q[0], q[2], None) if a.nd(2) == 3 else None
    return [(*q[:-1], v[-1]), softmax, lse, (2,)]


def _rope(a: Args) -> list[Expect]:
    return [a.opt("q"), a.opt("k"), a.opt("v")]


def _dropout_add(a: Args) -> list[Expect]:
    """out like x + y; seed_offset is the RNG seed and offset, [2]."""
    return [broadcast(a.s("x"), a.s("y")), (2,)]


def _flpga(a: Args) -> list[Expect]:
    x, d = a.s("x"), a.s("dout")
    if not x or not d:
        raise _Unknown
    return [(x[-1], d[-1]), (d[-1],) if a.a("has_bias", True) else None]


def _ints(v: Any, n: int, fill: int) -> list[int]:
    """A per-spatial-axis attribute: empty means ``fill``, one value means every axis."""
    vals = list(v or ())
    if not vals:
        return [fill] * n
    if len(vals) == 1:
        return vals * n
    if len(vals) != n:
        raise _Unknown
    return vals


def _conv_pads(v: Any, n: int) -> list[tuple[int, int]]:
    """Paddle's conv paddings: one per spatial axis (both sides) or (before, after) pairs."""
    p = list(v or ()) or [0]
    if len(p) == 1:
        p = p * n
    if len(p) == n:
        return [(x, x) for x in p]
    if len(p) == 2 * n:
        return [(p[2 * i], p[2 * i + 1]) for i in range(n)]
    raise _Unknown


def _conv_out(a: Args, x_sp: Sequence[int], k_sp: Sequence[int], transpose: bool) -> list[int | None]:
    """The spatial output sizes (Paddle's ConvInferMeta / ConvTransposeInferMeta)."""
    n = len(x_sp)
    st = _ints(a.a("strides"), n, 1)
    dil = _ints(a.a("dilations"), n, 1)
    alg = str(a.a("padding_algorithm", "EXPLICIT"))
    if any(v <= 0 for v in st + dil):
        raise _Unknown
    if alg == "SAME" and not transpose:
        return [-(-s // t) for s, t in zip(x_sp, st)]
    if alg == "VALID":
        pads = [(0, 0)] * n
    elif alg == "EXPLICIT":
        pads = _conv_pads(a.a("paddings"), n)
    else:
        return [None] * n
    if not transpose:
        return [(s + p[0] + p[1] - d * (k - 1) - 1) // t + 1 for s, k, t, p, d in zip(x_sp, k_sp, st, pads, dil)]
    size = list(a.a("output_size") or ())
    if size:
        return [v if isinstance(v, int) and v > 0 else None for v in _ints(size, n, 0)]
    extra = _ints(a.a("output_padding"), n, 0)
    return [(s - 1) * t - p[0] - p[1] + d * (k - 1) + 1 + e
            for s, k, t, p, d, e in zip(x_sp, k_sp, st, pads, dil, extra)]


def _conv_shape(a: Args, transpose: bool) -> list[Expect]:
    """Batch, channel and (where the rule takes the geometry attributes) spatial axes."""
    x, w = a.s("input"), a.s("filter")
    nd = len(x)
    if nd < 3 or len(w) != nd:
        raise _Unknown
    fmt = str(a.a("data_format", "NCHW"))
    last = fmt in ("NHWC", "NDHWC")
    x_sp = x[1:-1] if last else x[2:]
    if transpose:
        g = a.a("groups", 1)
        channels: int | None = w[1] * g if isinstance(g, int) and g > 0 else None
    else:
        channels = w[0]
    geometry = any(p.startswith("strides") for p in a.values)
    spatial = _conv_out(a, x_sp, w[2:], transpose) if geometry else [None] * len(x_sp)
    return [tuple([x[0], *spatial, channels] if last else [x[0], channels, *spatial])]


def _conv(a: Args) -> list[Expect]:
    return _conv_shape(a, False)


def _conv_transpose(a: Args) -> list[Expect]:
    return _conv_shape(a, True)


def _roi_align(a: Args) -> list[Expect]:
    x, boxes = a.s("x"), a.s("boxes")
    if len(x) != 4 or not boxes:
        raise _Unknown
    return [(boxes[0], x[1], a.a("pooled_height"), a.a("pooled_width"))]


def _moe_combine(a: Args) -> list[Expect]:
    x, w = a.s("x"), a.s("combine_weights")
    if len(x) != 2 or not w:
        raise _Unknown
    return [(w[0], x[1])]


def _moe_dispatch(a: Args) -> list[Expect]:
    """x [S, H], gate_logits [S, E], k, capacity: y [E, capacity, H] (the padded layout, the
    rule's rank-3 answer), combine_weights and expert_id [S, k], scatter_index [k, S],
    expert_offset [E]."""
    x, gl = a.s("x"), a.s("gate_logits")
    k, cap = a.a("k"), a.a("capacity")
    if len(x) != 2 or len(gl) != 2 or not isinstance(k, int) or not isinstance(cap, int):
        raise _Unknown
    s, e = gl
    y: Expect = (e, cap, x[1]) if a.nd(0) == 3 else None
    return [y, (s, k), (k, s), (e,), (s, k)]


def _moe_dispatch_grad(a: Args) -> list[Expect]:
    """grad_x [S, H] and grad_gate_logits [S, E] from combine_weights [S, k] and grad_y [E, C, H]."""
    cw, gy = a.s("combine_weights"), a.s("grad_y")
    if len(cw) != 2 or len(gy) != 3:
        raise _Unknown
    return [(cw[0], gy[2]), (cw[0], gy[0])]


def _in_place(pairs: Sequence[str]) -> ShapeFn:
    """Outputs that are updated inputs (``param_out`` of ``param``): each the shape of its input."""
    return lambda a: [a.opt(p) for p in pairs]


def _vec_like(vec: str, *rest: str) -> ShapeFn:
    def fn(a: Args) -> list[Expect]:
        out: list[Expect] = [list(a.vec(vec))]
        return out + [a.opt(r) for r in rest]

    return fn


def _coalesce(a: Args) -> list[Expect]:
    """output like input; fused_output [total elements], each input's count rounded up to
    align_size bytes (CoalesceTensorInferMeta) where use_align, align_size and size_of_dtype
    say it (a -1 size means the dtype's and place's default: not checked)."""
    xs = a.vec("input")
    out: list[Expect] = [list(xs)]
    counts = [math.prod(x) for x in xs if x is not None]
    if not a.a("use_align", True):
        return [*out, (sum(counts),)]
    align, size = a.a("align_size", -1), a.a("size_of_dtype", -1)
    if not (isinstance(align, int) and isinstance(size, int) and align > 0 and size > 0 and align % size == 0):
        return [*out, None]
    unit = align // size
    return [*out, (sum(-(-n // unit) * unit for n in counts),)]


def _check_finite(a: Args) -> list[Expect]:
    return [list(a.vec("xs")), None]


def _data_parallel(a: Args) -> list[Expect]:
    """default_data_parallel / replicated: ``outs`` describes the op's outputs, one each."""
    outs = a.vec("outs")
    if len(outs) != len(a.ndims):
        raise _Unknown
    return list(outs)


#: Shape functions by the rule's forward function (a family) ...
FAMILIES: dict[str, ShapeFn] = {
    **{f: _same() for f in (
        "ElementwiseUnaryInferSpmd", "CastInferSpmd", "EmptyLikeInferSpmd", "FullLikeInferSpmd",
        "CreateLikeInferSpmd", "SoftmaxInferSpmd", "GeluInferSpmd", "TrilTriuInferSpmd", "TriuInferSpmd",
        "RollInferSpmd", "LabelSmoothInferSpmd", "CummaxInferSpmd", "CumminInferSpmd", "ArgSortInferSpmd",
        "ScatterInferSpmd", "ScatterNdAddInferSpmd", "PutAlongAxisInferSpmd", "IndexPutInferSpmd")},
    "ElementwiseBinaryInferSpmd": _binary,
    "ElementwiseBinaryWithPartialInferSpmd": _binary,
    "WhereInferSpmd": _where,
    "AddNInferSpmd": _add_n,
    "SwiGLUInferSpmd": _swiglu,
    "ReductionInferSpmd": _reduction,
    "ReductionMeanInferSpmdDynamic": _reduction,
    "ReductionInferSpmdBase": _reduction,
    "LogSumExpInferSpmd": _reduction,
    "ArgMaxInferSpmdBase": _argminmax,
    "ArgMinInferSpmdBase": _argminmax,
    "PNormInferSpmd": _p_norm,
    "MeanAllInferSpmd": _scalar,
    "NumelInferSpmd": _scalar,
    "CumSumInferSpmd": _cumsum,
    "MatmulInferSpmd": _matmul,
    "BmmInferSpmd": _bmm,
    "LinearV2InferSpmdBase": _linear_v2,
    "FusedGemmEpilogueInferSpmdBase": _gemm,
    "EinsumInferSpmd": _einsum,
    "ConcatInferSpmd": _concat,
    "StackInferSpmd": _stack,
    "SplitInferSpmd": _split,
    "SplitWithNumInferSpmd": _split_with_num,
    "UnbindInferSpmd": _unbind,
    "TransposeInferSpmd": _transpose,
    "ReshapeInferSpmd": _reshape,
    "FlattenInferSpmd": _flatten,
    "SqueezeInferSpmd": _squeeze,
    "UnsqueezeInferSpmd": _unsqueeze,
    "ExpandInferSpmd": _expand,
    "ExpandAsInferSpmd": _expand_as,
    "TileInferSpmd": _tile,
    "SliceInferSpmd": _slice,
    "StridedSliceInferSpmd": _strided_slice,
    "PadInferSpmd": _pad,
    "GatherInferSpmdBase": _gather,
    "IndexSelectInferSpmd": _index_select,
    "GatherNdInferSpmd": _gather_nd,
    "TakeAlongAxisInferSpmd": _take_along_axis,
    "EmbeddingInferSpmd": _embedding,
    "CEmbeddingInferSpmd": lambda a: [a.s("x") + a.s("weight")[1:2]],
    "OneHotInferSpmd": _one_hot,
    "TopkInferSpmd": _topk,
    "NonZeroInferSpmd": _nonzero,
    "UniqueInferSpmd": _unique,
    "LayerNormInferSpmd": _layer_norm,
    "RmsNormInferSpmd": _rms_norm,
    "BatchNormInferSpmdStatic": _batch_norm,
    "GroupNormInferSpmdBase": _group_norm,
    "InstanceNormInferSpmd": _instance_norm,
    "CrossEntropyWithSoftmaxInferSpmdStatic": _cross_entropy,
    "CSoftmaxWithCrossEntropyInferSpmd": _c_softmax,
    "CSoftmaxWithMultiLabelCrossEntropyInferSpmd": _c_softmax_multi_label,
    "FlashAttInferSpmdStatic": _flash_attention,
    "FusedRopeInferSpmd": _rope,
    "FusedDropoutAddSpmdBase": _dropout_add,
    "FusedLinearParamGradAddInferSpmd": _flpga,
    "Conv2dInferSpmdBase": _conv,
    "Conv3dInferSpmd": _conv,
    "DepthwiseConv2dInferSpmd": _conv,
    "Conv2dTransposeInferSpmd": _conv_transpose,
    "RoiAlignInferSpmd": _roi_align,
    "MoECombineInferSpmd": _moe_combine,
    "MoEGateDispatchInferSpmd": _moe_dispatch,
    "MoEGateDispatchGradInferSpmd": _moe_dispatch_grad,
    "AdamInferSpmdDynamic": _in_place(("param", "moment1", "moment2", "moment2_max", "beta1_pow", "beta2_pow",
                                       "master_param")),
    "AdamwInferSpmdDynamic": _in_place(("param", "moment1", "moment2", "moment2_max", "beta1_pow", "beta2_pow",
                                        "master_param")),
    "SgdInferSpmd": _in_place(("param", "master_param")),
    "CheckFiniteAndUnscaleSpmd": _check_finite,
    "UpdateLossScalingSpmd": _vec_like("xs", "prev_loss_scaling", "in_good_steps", "in_bad_steps"),
    "CoalesceTensorInferSpmd": _coalesce,
    "DefaultDataParallelInferSpmd": _data_parallel,
    "ReplicatedInferSpmd": _data_parallel,
}

#: Outputs whose sizes the shapes and attributes do not fix, by rule, with the reason.
UNCHECKED: dict[str, str] = {
    "nonzero": "out's first axis is the number of nonzero elements (data); its second axis is checked",
    "unique": "out's, indices' and counts' length is the number of distinct values (data); inverse and "
              "out's other axes are checked",
    "moe_gate_dispatch": "y is checked in the padded layout only (the rule's rank-3 answer, [E, capacity, H])",
    "batch_norm": "reserve_space is kernel workspace; every other output is checked",
    "group_norm": "mean and variance are [N, groups] and the rule takes no groups: their N axis is checked",
    "flash_attention": "softmax's and softmax_lse's sequence axes (the kernel may round them up); their batch "
                       "and head axes, out and seed_offset are checked",
    "fused_gemm_epilogue": "reserve_space is kernel workspace; out is checked",
    "linear_v2": "reserve_space is kernel workspace; out is checked",
    "coalesce_tensor": "fused_output's size when align_size or size_of_dtype is -1 (the place's and dtype's "
                       "defaults); output is checked",
    "check_finite_and_unscale": "found_infinite is a flag whose shape the kernel picks; out is checked",
    "conv2d": "the rule takes no strides / paddings / dilations, so the output's spatial sizes are not "
              "fixed by the op; its batch and channel axes are checked",
}


# -- grad rules: each output has the shape of the forward input it is the gradient of ----------

#: Per grad rule, the forward inputs its outputs are gradients of, where the default (the base
#: rule's tensor inputs that the grad rule also takes, in order) does not say: a name the grad
#: rule takes gives that tensor's shape; ``"="`` the shape of the grad rule's last tensor (the
#: output gradient) for ops whose output has their input's shape.
GRAD_OUTPUTS: dict[str, tuple[str, ...]] = {
    "add_n_grad": ("inputs",),
    "c_softmax_with_cross_entropy_grad": ("softmax",),
    "c_softmax_with_multi_label_cross_entropy_grad": ("softmax",),
    "cross_entropy_with_softmax_grad": ("softmax",),
    "embedding_grad": ("weight",),
    "c_embedding_grad": ("weight",),
    "fused_dropout_add_grad": ("=", "="),
    "index_put_grad": ("x", "value"),
    "put_along_axis_grad": ("x", "value"),
    "label_smooth_grad": ("=",),
    "scatter_grad": ("=", "updates"),
    "scatter_nd_add_grad": ("=", "updates"),
    "where_grad": ("x", "y"),
    "fused_rotary_position_embedding_grad": ("out_q_grad", "out_k_grad", "out_v_grad"),
    "moe_combine_grad": ("x", "combine_weights", "scatter_index"),
    "rms_norm_grad": ("x", "scale"),
}


def _grad_special(name: str) -> ShapeFn | None:
    """Grad rules whose input shape is not one of their arguments: undo the forward shape change."""

    def split_grad(a: Args) -> list[Expect]:
        gs = [s for s in a.vec("out_grad") if s is not None]
        return _concat(Args({"x": gs, "axis": a.a("axis", -1)}, ["x"], [1]))

    def unbind_grad(a: Args) -> list[Expect]:
        gs = [s for s in a.vec("out_grad") if s is not None]
        return _stack(Args({"x": gs, "axis": a.a("axis", 0)}, ["x"], [1]))

    def stack_grad(a: Args) -> list[Expect]:
        return _unbind(Args({"x": a.s("output_grad"), "axis": a.a("axis", 0)}, ["x"], [1]))

    def transpose_grad(a: Args) -> list[Expect]:
        g = a.s("out_grad")
        perm = [p % len(g) for p in a.a("perm")]
        if sorted(perm) != list(range(len(g))):
            raise _Unknown
        out: list[int] = [0] * len(g)
        for i, p in enumerate(perm):
            out[p] = g[i]
        return [tuple(out)]

    def pad_grad(a: Args) -> list[Expect]:
        return [_padded(a.s("out_grad"), a.a("paddings"), -1)]

    def fused_gemm_epilogue_grad(a: Args) -> list[Expect]:
        x, y, g = a.s("x"), a.s("y"), a.s("out_grad")
        return [x, y, g[-1:] if g else None]

    def linear_v2_grad(a: Args) -> list[Expect]:
        w = a.s("weight")
        b = a.opt("bias")
        return [a.s("input"), w, b]

    return {"split_grad": split_grad, "split_with_num_grad": split_grad, "unbind_grad": unbind_grad,
            "stack_grad": stack_grad, "transpose_grad": transpose_grad, "pad_grad": pad_grad,
            "fused_gemm_epilogue_grad": fused_gemm_epilogue_grad,
            "linear_v2_grad": linear_v2_grad}.get(name)


#: view grads: x_grad has the shape the holder records (Paddle's xshape is [0, *x.shape])
_VIEW_GRADS = {"reshape_grad": "x_shape", "flatten_grad": "xshape", "squeeze_grad": "xshape",
               "unsqueeze_grad": "x"}


def _grad_sources(rule: Any) -> Sequence[str] | None:
    """The grad rule's inputs whose shapes its outputs have (see :data:`GRAD_OUTPUTS`)."""
    from spmdkit.engine.registry import get_rule, has_rule

    name = rule.name
    if name in GRAD_OUTPUTS:
        return GRAD_OUTPUTS[name]
    base_name = name[: -len("_grad")]
    if not name.endswith("_grad") or not has_rule(base_name):
        return None
    base = get_rule(base_name)
    mine = [p.name for p in rule.forward.params if p.is_tensor]
    fwd = [p.name for p in base.forward.params if p.is_tensor]
    srcs = [p for p in fwd if p in mine]
    if not srcs and len(fwd) == 1 and base.forward.function_name in _SHAPE_PRESERVING:
        return ("=",)
    return srcs


_SHAPE_PRESERVING = {"ElementwiseUnaryInferSpmd", "SoftmaxInferSpmd", "TrilTriuInferSpmd", "TriuInferSpmd",
                     "GeluInferSpmd", "CastInferSpmd", "CumSumInferSpmd"}


def _grad_fn(rule: Any) -> ShapeFn | None:
    special = _grad_special(rule.name)
    if special is not None:
        return special
    if rule.name in _VIEW_GRADS:
        holder = _VIEW_GRADS[rule.name]

        def view_grad(a: Args) -> list[Expect]:
            h = a.s(holder)
            if holder == "x":
                return [h]
            # the holder is x itself, or Paddle's xshape [0, *x.shape]: the rank says which
            nd = a.nd(0)
            if nd == len(h):
                return [h]
            if nd == len(h) - 1 and h and h[0] == 0:
                return [h[1:]]
            raise _Unknown

        return view_grad
    srcs = _grad_sources(rule)
    if srcs is None:
        return None
    tensors = [p.name for p in rule.forward.params if p.is_tensor]
    if any(s != "=" and s not in tensors for s in srcs):
        return None

    def grad(a: Args) -> list[Expect]:
        out: list[Expect] = []
        for s in srcs:
            if s == "=":
                out.append(a.s(tensors[-1]))
            else:
                v = a.values.get(s)
                out.append(list(v) if isinstance(v, list) else v)
        return out

    return grad


# -- the entry point --------------------------------------------------------------------------


_FNS: dict[str, ShapeFn | None] = {}


def shape_fn(rule: Any) -> ShapeFn | None:
    """The shape function of a rule (None where none is declared)."""
    if rule.name in _FNS:
        return _FNS[rule.name]
    fn = FAMILIES.get(rule.forward.function_name) or _grad_fn(rule)
    _FNS[rule.name] = fn
    return fn


def expected_output_shapes(rule: Any, values: Mapping[str, Any], ndims: Sequence[Any]) -> list[Expect]:
    """Per forward output of ``rule``: the shape the op makes (see the module doc), or None.
    ``values``: the forward arguments by parameter name (tensors as shape tuples); ``ndims``:
    the rule's answer's output ranks (a list per vector output). Never raises for a shape
    question it cannot answer: that output is None."""
    fn = shape_fn(rule)
    if fn is None:
        return [None] * len(ndims)
    tensors = [p.name for p in rule.forward.params if p.is_tensor]
    try:
        out = list(fn(Args(values, tensors, ndims)))
    except (_Unknown, IndexError, KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError):
        return [None] * len(ndims)
    out = out[: len(ndims)] + [None] * (len(ndims) - len(out))
    return [_agree(_clean(e), nd) for e, nd in zip(out, ndims)]


def _agree(e: Any, nd: Any) -> Any:
    """An answer whose rank differs from the rank the rule itself answers is not used (the
    rule's rank is checked separately; a disagreement is this table's doubt, not the program's
    error)."""
    if e is None:
        return None
    if isinstance(e, list):
        if not isinstance(nd, (list, tuple)) or len(nd) != len(e):
            return e if not isinstance(nd, (list, tuple)) else [None] * len(nd)
        return [x if x is None or n is None or len(x) == n else None for x, n in zip(e, nd)]
    if isinstance(nd, int) and len(e) != nd:
        return None
    return e


def _clean(e: Any) -> Any:
    """An answer as :data:`Expect`: a size that is not a non-negative int (a negative one from an
    impossible geometry, which the kernel refuses or clamps) is not checked."""
    if e is None:
        return None
    if isinstance(e, list):
        return [_clean(x) for x in e]
    if not isinstance(e, tuple):
        return None
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None for v in e)


def unchecked_rules() -> dict[str, str]:
    """Every rule with an output whose shape is not (fully) checked, with the reason: the
    documented list, plus rules without a shape function."""
    from spmdkit.engine.registry import all_rules

    out = dict(UNCHECKED)
    for r in {r.name: r for r in all_rules().values()}.values():
        if shape_fn(r) is None:
            out.setdefault(r.name, "no shape function declared (only the output rank is checked)")
    return out


__all__ = ["Args", "Expect", "FAMILIES", "GRAD_OUTPUTS", "UNCHECKED", "broadcast", "expected_output_shapes",
           "shape_fn", "unchecked_rules"]
