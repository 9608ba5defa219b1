"""The registry's declared backward kinds (reverse | grad) and derived reverse signatures."""

from __future__ import annotations

import pytest

from spmdkit.engine.registry import _CANONICAL, _ensure_loaded, backward_kind, is_reverse, output_params, register
from spmdkit.engine.signature import GRAD, REVERSE, parse_signature, reverse_signature

_ensure_loaded()

def _with_backward() -> list[str]:
    return sorted(n for n, r in _CANONICAL.items() if r.backward is not None)


def test_every_backward_kind_is_declared() -> None:
    undeclared = [n for n in _with_backward() if not _CANONICAL[n].backward.kind]  # type: ignore[union-attr]
    assert not undeclared, f"rules without a declared backward kind: {undeclared}"
    assert len(_with_backward()) > 150
    kinds = {backward_kind(_CANONICAL[n]) for n in _with_backward()}
    assert kinds == {REVERSE, GRAD}


@pytest.mark.parametrize("name", [n for n in _with_backward() if _CANONICAL[n].backward.kind == REVERSE])  # type: ignore[union-attr]
def test_reverse_signature_is_forward_plus_outputs(name: str) -> None:
    rule = _CANONICAL[name]
    assert rule.backward is not None and is_reverse(rule)
    fwd = rule.forward.params
    bwd = rule.backward.params
    tensors = [p.name for p in fwd if p.is_tensor]
    attrs = [p.name for p in fwd if not p.is_tensor]
    assert [p.name for p in bwd] == tensors + list(rule.outputs) + attrs
    assert output_params(rule) == list(rule.outputs)
    # the attributes keep the forward's kinds and defaults
    assert [p for p in bwd if not p.is_tensor] == [p for p in fwd if not p.is_tensor]


def test_grad_kind_is_not_reverse() -> None:
    grads = [n for n in _with_backward() if _CANONICAL[n].backward.kind == GRAD]  # type: ignore[union-attr]
    assert "argsort" in grads and "conv3d" in grads and "bmm" in grads
    assert not any(is_reverse(_CANONICAL[n]) for n in grads)
    assert is_reverse(_CANONICAL["add"]) and is_reverse(_CANONICAL["sum"])
    assert all(is_reverse(_CANONICAL[n]) for n in ("matmul", "layer_norm", "fused_rms_norm", "softmax", "log_softmax"))


def test_reverse_signature_text() -> None:
    sig = reverse_signature("x: T, axis: ints = [], keep_dim: bool = false, y: T? = None", "out: T, idx: T? = None")
    assert [(p.name, p.kind) for p in parse_signature(sig)] == [
        ("x", "T"), ("y", "T?"), ("out", "T"), ("idx", "T?"), ("axis", "ints"), ("keep_dim", "bool")]


def _f(*args: object) -> None:
    return None


@pytest.mark.parametrize(
    ("kw", "text"),
    [
        ({"kind": "reverse", "outputs": "out: T", "backward_sig": "x: T, out: T"}, "declares its outputs"),
        ({"kind": "grad", "outputs": "out: T"}, "declares its signature"),
        ({"kind": "grad"}, "declares its signature"),
        ({"kind": "sideways", "backward_sig": "x: T"}, "bad backward kind"),
        ({"backward_sig": "x: T, out: T"}, "bad backward kind"),
    ],
)
def test_register_refuses_bad_declarations(kw: dict, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        register("kind_test_rule_never_registered", _f, "x: T", _f, **kw)  # type: ignore[arg-type]


def test_register_refuses_kind_without_backward() -> None:
    with pytest.raises(ValueError, match="without a backward"):
        register("kind_test_rule_never_registered", _f, "x: T", kind="reverse")  # type: ignore[arg-type]


def test_grad_name_registers_the_grad_rule_itself() -> None:
    for fwd, grad in (("argsort", "argsort_grad"), ("cummax", "cummax_grad"), ("conv3d", "conv3d_grad")):
        f, g = _CANONICAL[fwd], _CANONICAL[grad]
        assert f.backward is not None and g.backward is None
        assert g.forward.fn is f.backward.fn
        assert g.forward.params == f.backward.params
        assert g.forward.function_name == f.backward.function_name
    from spmdkit.engine.registry import get_rule

    assert get_rule("expand_as_v2_grad") is _CANONICAL["expand_as_grad"]


def test_grad_name_needs_a_grad_rule() -> None:
    with pytest.raises(ValueError, match="needs a grad rule"):
        register("kind_test_rule_never_registered", _f, "x: T", _f, kind="reverse", outputs="out: T",  # type: ignore[arg-type]
                 grad_name="kind_test_rule_never_registered_grad")
    assert "kind_test_rule_never_registered" not in _CANONICAL
