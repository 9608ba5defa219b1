"""Layers into pipeline stages: the even split and the split balanced by cost."""

from __future__ import annotations

from spmdkit.core.errors import ProgramError


def even_split(total: int, n: int) -> list[int]:
    """``total`` layers in ``n`` stages as evenly as they go (the first stages one more)."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def balanced_split(layer_costs: list[float], n: int, first: float = 0.0, last: float = 0.0) -> tuple[int, ...]:
    """The layers (each of cost ``layer_costs[i]``) cut into ``n`` contiguous stages of at
    least one layer, the first stage also paying ``first`` (the embedding), the last ``last``
    (the final norm, the head and the loss), so that the costliest stage is as cheap as it can
    be (binary search on that bound, each bound checked by packing the stages greedily).
    Among the splits that reach it, the layers go to the middle stages first: the last stage
    packed from the back, then the middle ones, the first stage taking what is left (fewer
    layers on the first stage, which also keeps the most microbatches in flight), as Megatron
    users split Llama 3.1 405B's 126 layers on 16 stages: 7, 8 x 14, 7."""
    L = len(layer_costs)
    if not 1 <= n <= L:
        raise ProgramError(f"--stages: {L} layers cannot fill {n} stages (each needs at least one layer)")
    tol = 1e-9 * (sum(layer_costs) + first + last + 1e-300)

    def pack(bound: float) -> list[int] | None:
        """Counts, stage n-1 first, each stage as full as ``bound`` allows (None: does not fit)."""
        counts: list[int] = []
        hi = L  # layers [0, hi) not yet placed
        for k in range(n - 1, 0, -1):
            cost, c = (last if k == n - 1 else 0.0), 0
            while hi - c > k and (c == 0 or cost + layer_costs[hi - c - 1] <= bound + tol):
                cost += layer_costs[hi - c - 1]
                c += 1
            if cost > bound + tol:
                return None
            counts.append(c)
            hi -= c
        if first + sum(layer_costs[:hi]) + (last if n == 1 else 0.0) > bound + tol:
            return None
        counts.append(hi)
        return counts[::-1]

    lo_b = max(max(layer_costs), first + layer_costs[0], last + layer_costs[-1])
    hi_b = sum(layer_costs) + first + last
    best = pack(hi_b)
    for _ in range(100):
        if hi_b - lo_b <= tol:
            break
        mid = (lo_b + hi_b) / 2
        got = pack(mid)
        if got is None:
            lo_b = mid
        else:
            best, hi_b = got, mid
    got = pack(lo_b)
    out = got if got is not None else best
    assert out is not None and sum(out) == L
    return tuple(out)


__all__ = ["balanced_split", "even_split"]
