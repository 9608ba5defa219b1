"""spmdkit.io: the JSON-lines case and result codec (INTERFACE.md)."""

from spmdkit.io.codec import (
    Case,
    answer_line,
    decode_attr,
    dumps,
    encode_attr,
    encode_error,
    encode_result,
    parse_case,
    parse_mesh,
    parse_tensor,
)

__all__ = [
    "Case",
    "answer_line",
    "decode_attr",
    "dumps",
    "encode_attr",
    "encode_error",
    "encode_result",
    "parse_case",
    "parse_mesh",
    "parse_tensor",
]
