"""The mesh and the tensors' sharding on the page of ``spmdkit plan --html``
(:mod:`spmdkit.outputs.html`): every rank at its mesh coordinates, outlined by its node, and each
tensor of layer 0 (and those outside the layers) drawn as
``torch.distributed.tensor.debug.visualize_sharding`` draws a DTensor: the global shape as a grid
of blocks labelled with the ranks holding them, a partial tensor hatched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.outputs.html_figures import esc, rank_colour, rank_coords, rank_ranges
from spmdkit.outputs.report import placements
from spmdkit.program.layers import program_layers
from spmdkit.program.plan import Plan

#: The most blocks drawn along one side of a tensor's grid (a larger mesh: the first ones, and a note).
MAX_BLOCKS = 64


# -- the mesh -------------------------------------------------------------------------------------


def _mesh_svg(names: Sequence[str], shape: Sequence[int], ids: Sequence[int], per_node: int) -> str:
    cols = shape[-1]
    rows = len(ids) // cols
    cw, ch = (64, 34) if len(ids) <= 64 else (40, 22)
    pad_l, pad_t = 8, 8
    w, h = pad_l + cols * cw + 8, pad_t + rows * ch + 8
    parts = [f'<svg class="fig mesh" data-figure="mesh" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
             f'role="img" aria-label="mesh of {len(ids)} ranks">']
    for k, rid in enumerate(ids):
        r, c = divmod(k, cols)
        node = rid // per_node
        coords = ", ".join(f"{n}={v}" for n, v in zip(names, rank_coords(shape, k)))
        x, y = pad_l + c * cw, pad_t + r * ch
        parts.append(f'<g class="rank"><title>rank {rid} ({coords}), node {node}</title>'
                     f'<rect x="{x + 2}" y="{y + 2}" width="{cw - 4}" height="{ch - 4}" rx="4" '
                     f'fill="{rank_colour(node)}" stroke="#fff" stroke-width="1"/>'
                     f'<text x="{x + cw / 2}" y="{y + ch / 2 + 4}" text-anchor="middle" class="lbl">{rid}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def mesh_section(mesh: Any, per_node: int) -> str:
    names, shape = list(mesh.dim_names), list(mesh.shape)
    ids = list(mesh.process_ids)
    n_nodes = (max(ids) // per_node) + 1
    rows = []
    for d, (nm, s) in enumerate(zip(names, shape)):
        inside = True
        for k in range(len(ids)):
            c = rank_coords(shape, k)
            if c[d] != 0:
                continue
            stride = 1
            for x in shape[d + 1:]:
                stride *= x
            group = [ids[k + j * stride] for j in range(s)]
            if len({g // per_node for g in group}) > 1:
                inside = False
                break
        rows.append(f"<tr><td>{esc(nm)}</td><td>{s}</td><td>{'inside a node (NVLink)' if inside else 'across nodes'}"
                    f"</td></tr>")
    if n_nodes <= 4:
        nodes = "; ".join(f"node {n}: ranks {rank_ranges([i for i in ids if i // per_node == n])}" for n in range(n_nodes))
    else:
        nodes = f"node n: ranks {per_node}n to {per_node}n+{per_node - 1}"
    return (f'<section id="mesh"><h2>Mesh</h2><p>{" x ".join(f"{esc(n)}={s}" for n, s in zip(names, shape))}: '
            f'{len(ids)} ranks on {n_nodes} node{"s" if n_nodes != 1 else ""} of {per_node} ranks '
            f'(rows: {" x ".join(esc(n) for n in names[:-1]) or "-"}, columns: {esc(names[-1])}; coloured by '
            f'node). {esc(nodes)}.</p><div class="row">{_mesh_svg(names, shape, ids, per_node)}'
            f'<table class="small"><tr><th>mesh dim</th><th>size</th><th>its groups</th></tr>{"".join(rows)}'
            f'</table></div></section>')


# -- a tensor's sharding --------------------------------------------------------------------------


def shard_blocks(attr: TensorDistAttr, ndim: int) -> tuple[int, int, dict[tuple[int, int], list[int]]]:
    """(rows, columns, (row, column) -> the ranks holding that block) of a tensor of ``ndim``
    axes under ``attr``: the leading axes flattened into the rows, the last axis across."""
    mesh = attr.mesh
    shape = list(mesh.shape)
    parts = []
    for axis in range(ndim):
        k = 1
        for d in entry_dims(attr.dims_mapping[axis]):
            k *= shape[d]
        parts.append(k)
    lead = parts[:-1] if ndim >= 2 else []
    n_rows = 1
    for k in lead:
        n_rows *= k
    n_cols = parts[-1] if ndim >= 1 else 1
    blocks: dict[tuple[int, int], list[int]] = {}
    ids = list(mesh.process_ids)
    for k, rid in enumerate(ids):
        c = rank_coords(shape, k)
        idx = []
        for axis in range(ndim):
            i = 0
            for d in entry_dims(attr.dims_mapping[axis]):  # major to minor
                i = i * shape[d] + c[d]
            idx.append(i)
        row = 0
        for axis in range(ndim - 1 if ndim >= 2 else 0):
            row = row * parts[axis] + idx[axis]
        col = idx[-1] if ndim >= 1 else 0
        blocks.setdefault((row, col), []).append(rid)
    return n_rows, n_cols, blocks


def _tensor_svg(name: str, shape: Sequence[int], attr: TensorDistAttr) -> str:
    rows, cols, blocks = shard_blocks(attr, len(shape))
    shown_r, shown_c = min(rows, MAX_BLOCKS), min(cols, MAX_BLOCKS)
    width = 240
    cw = width / shown_c
    ch = max(10.0, min(30.0, 180 / shown_r))
    h = ch * shown_r
    partial = [(attr.mesh.dim_names[d], r.value) for d, r in attr.partial]
    parts = [f'<svg class="fig tensor" data-figure="tensor" data-tensor="{esc(name)}" data-blocks="{len(blocks)}" '
             f'width="{width + 2}" height="{h + 2:.0f}" viewBox="-1 -1 {width + 2} {h + 2:.0f}" role="img" '
             f'aria-label="sharding of {esc(name)}">']
    order = {key: k for k, key in enumerate(sorted(blocks))}
    for (r, c), ranks in sorted(blocks.items()):
        if r >= shown_r or c >= shown_c:
            continue
        x, y = c * cw, r * ch
        label = "all" if len(ranks) == attr.mesh.size and len(ranks) > 1 else rank_ranges(ranks)
        parts.append(f'<g class="block"><title>block ({r}, {c}): ranks {rank_ranges(ranks)}</title>'
                     f'<rect x="{x:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" '
                     f'fill="{rank_colour(order[(r, c)])}" stroke="#fff" stroke-width="1"/>')
        if partial:
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" fill="url(#hatch)" '
                         f'class="partial"/>')
        if cw >= 7 * len(label) + 4 and ch >= 12:
            parts.append(f'<text x="{x + cw / 2:.1f}" y="{y + ch / 2 + 4:.1f}" text-anchor="middle" '
                         f'class="lbl">{esc(label)}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def sharding_section(plan: Plan) -> str:
    prog = plan.program
    layers = program_layers(prog)
    of = layers.tensor_layer
    full = sorted({k: i for i, k in reversed(list(enumerate(layers.kind)))}.values())  # the first of each structure
    names = [n for f in full for n, t in prog.tensors.items() if of.get(n) == f and not t.inplace_of
             and t.kind in ("parameter", "activation", "gradient")]
    names += [n for n, t in prog.tensors.items() if n not in of and not t.inplace_of
              and t.kind in ("input", "parameter", "activation")]
    if not names:  # a program without layers: its parameters and inputs
        names = [t.name for t in prog.tensors.values() if t.kind in ("input", "parameter") and not t.inplace_of]
    cards = []
    for n in names:
        t = prog.tensors[n]
        a = plan.attrs[n]
        local = []
        for size, e in zip(t.shape, a.dims_mapping):
            k = 1
            for d in entry_dims(e):
                k *= a.mesh.shape[d]
            local.append(-(-size // k))
        rows, cols, _ = shard_blocks(a, len(t.shape))
        partial = ", ".join(f"{a.mesh.dim_names[d]} ({r.value})" for d, r in a.partial)
        cut = " (the first 64 blocks a side)" if rows > MAX_BLOCKS or cols > MAX_BLOCKS else ""
        cards.append(f'<div class="card" data-name="{esc(n)}" data-kind="{esc(t.kind)}"><div class="name">{esc(n)}</div>'
                     f'<div class="meta">{esc(t.kind)} {esc(list(t.shape))} {esc(t.dtype)} &rarr; local '
                     f'{esc(local)}<br>{esc(placements(a))}'
                     + (f'<br><b>partial</b> over {esc(partial)}: each block is the sum of the ranks\' values'
                        if partial else "")
                     + f'{cut}</div>{_tensor_svg(n, t.shape, a)}</div>')
    more = (f" (and of layer{'s' if len(full) > 2 else ''} {', '.join(map(str, full[1:]))}, the first of another "
            f"structure)") if len(full) > 1 else ""
    return (f'<section id="sharding"><h2>Sharding</h2><p>Each tensor of layer 0{esc(more)} and those outside the layers: '
            'the global shape as a grid of blocks (leading axes flattened into the rows, the last axis across), '
            'each labelled with the ranks holding it; a hatched block is partial. '
            '<input id="tensor-filter" placeholder="filter tensors" aria-label="filter tensors"></p>'
            f'<div class="cards">{"".join(cards)}</div></section>')


__all__ = ["MAX_BLOCKS", "mesh_section", "shard_blocks", "sharding_section"]
