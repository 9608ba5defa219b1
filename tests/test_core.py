"""The data model: meshes, dist attrs, specs, results, validation errors, interop."""

from __future__ import annotations

import pickle

import pytest

from spmdkit.core import (
    DistTensorSpec,
    InvalidDimsMappingError,
    InvalidMeshError,
    InvalidPartialError,
    Partial,
    ProcessMesh,
    ReduceType,
    Replicate,
    ShapeMismatchError,
    Shard,
    SpmdError,
    SpmdResult,
    TensorDistAttr,
    from_partition_spec,
    from_placements,
    to_partition_spec,
    to_placements,
)

MESH = ProcessMesh([2, 3], dim_names=["dp", "tp"])


class TestProcessMesh:
    def test_defaults(self) -> None:
        m = ProcessMesh([2, 4])
        assert m.shape == (2, 4)
        assert m.ndim == 2
        assert m.size == 8
        assert m.process_ids == tuple(range(8))
        assert m.dim_names == ("d0", "d1")
        assert m.dim_size("d1") == 4
        assert m.coords(5) == (1, 1)

    def test_equality_and_hash(self) -> None:
        a = ProcessMesh([2, 2], [0, 1, 2, 3])
        b = ProcessMesh((2, 2))
        c = ProcessMesh([2, 2], [3, 2, 1, 0])
        assert a == b and hash(a) == hash(b)
        assert a != c
        assert len({a, b, c}) == 2

    def test_immutable_and_picklable(self) -> None:
        with pytest.raises(AttributeError):
            MESH._shape = (1,)  # type: ignore[misc]
        assert pickle.loads(pickle.dumps(MESH)) == MESH

    @pytest.mark.parametrize(
        ("args", "fragment"),
        [
            (([],), "at least one dim"),
            (([0, 2],), "positive ints"),
            (([2, True],), "positive ints"),
            (("23",), "list of positive ints"),
            (([2, 2], [0, 1, 2]), "3 entries"),
            (([2], [0, 0]), "duplicates"),
            (([2], [0, -1]), "non-negative"),
            (([2, 2], None, ["a"]), "dim_names has 1 entries"),
            (([2, 2], None, ["a", "a"]), "duplicates"),
        ],
    )
    def test_invalid(self, args: tuple, fragment: str) -> None:
        with pytest.raises(InvalidMeshError, match=fragment):
            ProcessMesh(*args)

    def test_dim_index_errors(self) -> None:
        with pytest.raises(InvalidMeshError, match="no dim named 'pp'"):
            MESH.dim_index("pp")
        with pytest.raises(InvalidMeshError, match="out of range"):
            MESH.dim_index(2)


class TestTensorDistAttr:
    def test_normalisation(self) -> None:
        a = TensorDistAttr(MESH, [0, [1], [], -1])
        assert a.dims_mapping == (0, 1, -1, -1)
        b = TensorDistAttr(MESH, [[0, 1], -1])
        assert b.dims_mapping == ((0, 1), -1)
        assert b.sharded_mesh_dims() == (0, 1)

    def test_partial_forms(self) -> None:
        a = TensorDistAttr(MESH, [-1, 0], [1])
        b = TensorDistAttr(MESH, [-1, 0], {"1": "sum"})
        c = TensorDistAttr(MESH, [-1, 0], {1: ReduceType.SUM})
        assert a == b == c and len({a, b, c}) == 1
        m = TensorDistAttr(MESH, [-1, -1], {0: "max", 1: "avg"})
        assert m.partial_status == {0: ReduceType.MAX, 1: ReduceType.AVG}
        assert m.partial_dims == (0, 1)
        assert m.is_partial() and not m.is_replicated()

    def test_hash_distinguishes(self) -> None:
        assert TensorDistAttr(MESH, [0, -1]) != TensorDistAttr(MESH, [-1, 0])
        assert TensorDistAttr(MESH, [0, -1]) != TensorDistAttr(MESH, [0, -1], [1])
        assert TensorDistAttr(MESH, [0, -1], {1: "sum"}) != TensorDistAttr(MESH, [0, -1], {1: "max"})
        assert TensorDistAttr(MESH, [[0, 1]]) != TensorDistAttr(MESH, [[1, 0]])
        assert TensorDistAttr(ProcessMesh([6]), [0]) != TensorDistAttr(ProcessMesh([3, 2]), [0])

    def test_replace_and_immutable(self) -> None:
        a = TensorDistAttr(MESH, [0, -1])
        b = a.replace(partial=[1])
        assert b.partial_dims == (1,) and a.partial == ()
        with pytest.raises(AttributeError):
            a.dims_mapping = (1,)  # type: ignore[misc]
        assert pickle.loads(pickle.dumps(b)) == b

    @pytest.mark.parametrize(
        ("dm", "partial", "err", "fragment"),
        [
            ([0, 0], None, InvalidDimsMappingError, "mesh dim 0 shards more than one axis"),
            ([[0, 1], 1], None, InvalidDimsMappingError, "mesh dim 1 shards more than one axis"),
            ([[0, 0]], None, InvalidDimsMappingError, "used twice"),
            ([2, -1], None, InvalidDimsMappingError, "mesh dim 2 out of range"),
            ([-2], None, InvalidDimsMappingError, "out of range"),
            (["x"], None, InvalidDimsMappingError, "is not -1"),
            ([0, -1], [0], InvalidPartialError, "mesh dim 0 is both partial and sharding"),
            ([-1], [5], InvalidPartialError, "out of range"),
            ([-1], {"1": "median"}, InvalidPartialError, "unknown reduce type 'median'"),
            ([-1], {1: "sum", "1": "max"}, InvalidPartialError, "given twice"),
            ([-1], "sum", InvalidPartialError, "partial must be"),
        ],
    )
    def test_invalid(self, dm: list, partial: object, err: type, fragment: str) -> None:
        with pytest.raises(err, match=fragment):
            TensorDistAttr(MESH, dm, partial)
        assert issubclass(err, SpmdError)

    def test_mesh_type(self) -> None:
        with pytest.raises(InvalidDimsMappingError, match="ProcessMesh"):
            TensorDistAttr([2, 3], [0])  # type: ignore[arg-type]


class TestSpec:
    def test_spec(self) -> None:
        s = DistTensorSpec([4, 6], TensorDistAttr(MESH, [0, 1]))
        t = DistTensorSpec((4, 6), mesh=MESH, dims_mapping=[0, 1])
        assert s == t and hash(s) == hash(t)
        assert s.ndim == 2 and s.mesh == MESH
        assert DistTensorSpec([4, 6], mesh=MESH).dims_mapping == (-1, -1)
        assert pickle.loads(pickle.dumps(s)) == s

    def test_wrong_length(self) -> None:
        with pytest.raises(InvalidDimsMappingError, match="has 1 entries but the tensor has 2 dims"):
            DistTensorSpec([4, 6], TensorDistAttr(MESH, [0]))

    @pytest.mark.parametrize("shape", [[4, -2], [4.0], "46", [True]])
    def test_bad_shape(self, shape: object) -> None:
        with pytest.raises(ShapeMismatchError):
            DistTensorSpec(shape, mesh=MESH)  # type: ignore[arg-type]

    def test_result(self) -> None:
        a = TensorDistAttr(MESH, [0, -1])
        r = SpmdResult([a, None, [a, a]], [a])
        assert r.inputs == (a, None, (a, a))
        ins, outs = r
        assert ins == (a, None, (a, a))
        assert outs == (a,)
        assert r == SpmdResult((a, None, (a, a)), (a,))
        assert hash(r) == hash(SpmdResult((a, None, (a, a)), (a,)))


class TestPlacements:
    def test_round_trip(self) -> None:
        a = TensorDistAttr(MESH, [1, -1, -1], {0: "avg"})
        p = to_placements(a)
        assert p == (Partial("avg"), Shard(0))
        assert from_placements(MESH, p, 3) == a

    def test_coshard(self) -> None:
        m = ProcessMesh([2, 2, 2])
        a = TensorDistAttr(m, [[0, 2], 1])
        assert to_placements(a) == (Shard(0), Shard(1), Shard(0))
        assert from_placements(m, to_placements(a), 2) == a
        with pytest.raises(InvalidDimsMappingError, match="cannot express"):
            to_placements(TensorDistAttr(m, [[2, 0], 1]))

    def test_from_placements_errors(self) -> None:
        with pytest.raises(InvalidDimsMappingError, match="2 placements"):
            from_placements(ProcessMesh([2]), [Replicate(), Replicate()], 1)
        with pytest.raises(InvalidDimsMappingError, match="axis out of range"):
            from_placements(ProcessMesh([2]), [Shard(3)], 2)
        assert from_placements(ProcessMesh([2]), [Shard(-1)], 2).dims_mapping == (-1, 0)

    def test_partition_spec(self) -> None:
        m = ProcessMesh([2, 2, 2], dim_names=["dp", "fsdp", "tp"])
        a = TensorDistAttr(m, [[0, 1], -1, 2])
        spec = to_partition_spec(a)
        assert spec == (("dp", "fsdp"), None, "tp")
        assert from_partition_spec(m, spec) == a
        assert from_partition_spec(m, ("tp",), ndim=3).dims_mapping == (2, -1, -1)
        with pytest.raises(InvalidPartialError, match="no PartitionSpec form"):
            to_partition_spec(TensorDistAttr(m, [-1], [0]))
        with pytest.raises(InvalidMeshError, match="no dim named"):
            from_partition_spec(m, ("pp",))

    def test_torch_placements(self) -> None:
        torch_tensor = pytest.importorskip("torch.distributed.tensor", reason="torch is not installed")
        from spmdkit.core import to_torch_placements

        a = TensorDistAttr(MESH, [1, -1], {0: "sum"})
        tp = to_torch_placements(a)
        assert tp == (torch_tensor.Partial("sum"), torch_tensor.Shard(0))
        assert from_placements(MESH, tp, 2) == a


def test_signature_defaults_may_hold_commas() -> None:
    """A list default (``ints = [1, 1]``) or a string with a comma does not split a parameter."""
    from spmdkit.engine.signature import parse_signature

    ps = parse_signature('x: T, strides: ints = [1, 1], name: str = "a,b", axis: int = -1')
    assert [(p.name, p.kind, p.default) for p in ps[1:]] == [("strides", "ints", (1, 1)), ("name", "str", "a,b"),
                                                            ("axis", "int", -1)]
    assert ps[0].name == "x" and ps[0].required
