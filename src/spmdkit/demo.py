"""``spmdkit demo``: a short tour of the main job."""

from __future__ import annotations

from typing import TextIO


def run_demo(out: TextIO) -> int:
    from spmdkit import DistTensorSpec, ProcessMesh, TensorDistAttr, get_rule
    from spmdkit.report import fmt_attr

    mesh = ProcessMesh([2, 4], dim_names=["dp", "tp"])
    out.write(f"mesh {list(mesh.shape)} dims {list(mesh.dim_names)}\n")
    x = DistTensorSpec([8, 1024, 4096], TensorDistAttr(mesh, [0, -1, -1]))
    r = get_rule("transpose").infer_forward(x, [1, 0, 2])
    out.write(f"transpose x{list(x.shape)} {fmt_attr(x.dist_attr)} perm [1,0,2] -> out {fmt_attr(r.outputs[0])}\n")
    return 0
