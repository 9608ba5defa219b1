"""HuggingFace transformers models by class name and config, with example inputs in their valid
ranges, imported as spmdkit programs (``pip install 'spmdkit[hf]'``).

``build("LlamaForCausalLM", {"num_hidden_layers": 2, ...}, dtype="bfloat16")`` makes the model
from its config class (no hub access), seeded; ``example_inputs(model, batch, seq)`` gives the
keyword inputs its forward takes: token ids below the vocabulary size, an attention mask (with
``pad`` padded positions at the end of the last row), labels with some -100 (the ignored
index), ``pixel_values`` for a vision model, ``input_features`` for a speech encoder-decoder (Whisper),
``decoder_input_ids`` for an encoder-decoder called without labels; ``import_hf`` does both and :func:`spmdkit.models.torch_import.import_module`. Nothing
in the spmdkit core imports this module.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from spmdkit.core.errors import ProgramError

_DTYPES = {"float32": "float32", "fp32": "float32", "float64": "float64", "fp64": "float64",
           "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ProgramError("hf: transformers is not installed (pip install 'spmdkit[hf]')") from None
    return transformers


def load_config(config: Any) -> dict[str, Any]:
    """A config as a dict: a mapping, a JSON object text, or the path of a JSON file (an HF
    ``config.json``)."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, str):
        raise ProgramError(f"hf: config must be a dict, a JSON object or a JSON file path, got {type(config).__name__}")
    text = config
    if not config.lstrip().startswith("{"):
        if not os.path.isfile(config):
            raise ProgramError(f"hf: config {config!r} is neither a JSON object nor an existing file")
        with open(config, encoding="utf-8") as f:
            text = f.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProgramError(f"hf: config is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProgramError("hf: config must be a JSON object")
    return obj


def dtype_name(dtype: str) -> str:
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ProgramError(f"hf: dtype {dtype!r} is not one of {', '.join(sorted(_DTYPES))}") from None


def build(class_name: str, config: Any, *, dtype: str = "float32", seed: int = 0) -> Any:
    """The transformers model ``class_name`` (``LlamaForCausalLM``) from ``config`` (see
    :func:`load_config`) through its config class, random weights from ``seed``, in ``dtype``,
    in eval mode."""
    import torch

    tf = _transformers()
    cls = getattr(tf, class_name, None)
    cfg_cls = getattr(cls, "config_class", None)
    if cls is None or cfg_cls is None or not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise ProgramError(f"hf: transformers has no model class {class_name!r}")
    cfg = load_config(config)
    cfg.pop("architectures", None)
    try:
        conf = cfg_cls(**cfg)
    except (TypeError, ValueError) as exc:
        raise ProgramError(f"hf: {cfg_cls.__name__} rejects the config: {exc}") from None
    dt = getattr(torch, dtype_name(dtype))
    n = _param_count(cls, conf)
    need = n * max(torch.empty((), dtype=dt).element_size(), 4)  # built in float32, then cast
    have = _available_bytes()
    if have is not None and need > MEMORY_FRACTION * have:
        raise ProgramError(f"hf: {class_name} with this config has {n / 1e9:.2f} billion parameters, "
                           f"{need / 2**30:.1f} GiB while it is built (float32, then {dtype_name(dtype)}); "
                           f"this machine has {have / 2**30:.1f} GiB available and the model is built in "
                           f"memory: use fewer layers or a smaller config")
    torch.manual_seed(seed)
    model = cls(conf).to(dt)
    model.eval()
    return model


#: ``build`` refuses a model whose parameters would take more than this share of the memory
#: available, instead of letting the operating system kill the process.
MEMORY_FRACTION = 0.5


def _param_count(cls: Any, conf: Any) -> int:
    """Elements of ``cls(conf)``'s parameters and buffers, counted on the meta device (nothing
    allocated)."""
    import torch

    with torch.device("meta"):
        m = cls(conf)
    return int(sum(t.numel() for t in (*m.parameters(), *m.buffers())))


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None (not checked)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def example_inputs(model: Any, batch: int = 2, seq: int = 16, *, labels: bool = True, pad: int = 0,
                   ignored: float = 0.1, seed: int = 0) -> dict[str, Any]:
    """Keyword inputs for ``model`` in their valid ranges (see the module docstring); ``ignored``:
    the fraction of labels set to -100 (at least one label stays counted); ``pad``: padded
    positions (attention mask 0) at the end of the last row. A speech encoder-decoder (Whisper:
    ``input_features``) gets log-mel features ``[batch, num_mel_bins, 2 * max_source_positions]``
    (the length its encoder requires) and ``seq`` decoder tokens; an encoder-decoder's decoder
    reads its labels shifted right (HF's own shift), or ``decoder_input_ids`` without labels."""
    import torch

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    main = getattr(model, "main_input_name", "input_ids")
    kw: dict[str, Any] = {}
    if main == "pixel_values":
        size = getattr(cfg, "image_size", 224)
        size = size if isinstance(size, (list, tuple)) else (size, size)
        kw["pixel_values"] = torch.randn(batch, getattr(cfg, "num_channels", 3), *size, generator=g).to(model.dtype)
        if labels:
            n = int(getattr(cfg, "num_labels", 2))
            kw["labels"] = torch.randint(0, n, (batch,), generator=g)
        return kw
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if vocab < 1:
        raise ProgramError(f"hf: {type(model).__name__} has no vocab_size in its config")
    if main == "input_features":
        mels = int(getattr(cfg, "num_mel_bins", 80))
        frames = 2 * int(getattr(cfg, "max_source_positions", 1500))
        kw["input_features"] = torch.randn(batch, mels, frames, generator=g).to(model.dtype)
        most = int(getattr(cfg, "max_target_positions", seq) or seq)
        if seq > most:
            raise ProgramError(f"hf: seq={seq} is more than the decoder's max_target_positions {most}")
    else:
        kw["input_ids"] = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        if pad:
            if not 0 <= pad < seq:
                raise ProgramError(f"hf: pad={pad} must be in [0, seq={seq})")
            mask[-1, seq - pad:] = 0
        kw["attention_mask"] = mask
    if labels:
        lab = torch.randint(0, vocab, (batch, seq), generator=g)
        drop = torch.rand(batch, seq, generator=g) < ignored
        drop[0, 0] = False  # at least one counted label
        lab[drop] = -100
        kw["labels"] = lab
    elif getattr(cfg, "is_encoder_decoder", False):
        kw["decoder_input_ids"] = torch.randint(0, vocab, (batch, seq), generator=g)
    return kw


def import_hf(class_name: str, config: Any, *, batch: int = 2, seq: int = 16, dtype: str = "float32",
              training: bool = True, pad: int = 0, seed: int = 0, **opts: Any) -> tuple[Any, Any, dict[str, Any]]:
    """``build`` + ``example_inputs`` + ``import_module``: (program, model, keyword inputs).
    ``opts`` go to :func:`spmdkit.models.torch_import.import_module` (``fallback``, ``optimizer``, ...)."""
    from spmdkit.models.torch_import import import_module

    model = build(class_name, config, dtype=dtype, seed=seed)
    kw = example_inputs(model, batch, seq, labels=training, pad=pad, seed=seed)
    prog = import_module(model, (), kw, training=training, **opts)
    return prog, model, kw


__all__ = ["build", "dtype_name", "example_inputs", "import_hf", "load_config"]
