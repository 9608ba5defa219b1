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

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.models.hf_attention import attention_note, unmasked_attention
from spmdkit.models.hf_checks import check_hf_config
from spmdkit.models.hf_cp import check as check_cp
from spmdkit.models.hf_cp import cp_call

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
    ``config.json``, or the model folder holding it)."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, str):
        raise ProgramError(f"hf: config must be a dict, a JSON object or a JSON file path, got {type(config).__name__}")
    text = config
    if not config.lstrip().startswith("{"):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        if os.path.isdir(config) and not os.path.isfile(path):
            raise ProgramError(f"hf: config {config!r} is a folder with no config.json in it")
        if not os.path.isfile(path):
            raise ProgramError(f"hf: config {config!r} is neither a JSON object nor an existing file")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as exc:
            raise ProgramError(f"hf: config {path!r} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                               f"give the model's config.json") from None
        except OSError as exc:
            raise ProgramError(f"hf: config {path!r} cannot be read: {exc.strerror or exc}") from None
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


def build(class_name: str, config: Any, *, dtype: str = "float32", seed: int = 0, weights: bool = True) -> Any:
    """The transformers model ``class_name`` (``LlamaForCausalLM``) from ``config`` (see
    :func:`load_config`) through its config class, in ``dtype`` directly (torch's default dtype
    while it is made, as HF's ``from_pretrained(dtype=...)``: no float32 copy first; what the
    model makes in float32 on purpose, a router or a rotary table, stays float32), in eval mode.

    ``weights=True``: random weights from ``seed`` (refused when they would not fit in memory);
    ``weights=False``: every parameter a fake tensor (shape, dtype, no storage: any size builds
    in a few MB) and the buffers real (a rotary table, a mask: the importer reads their values),
    enough to import and plan the model but not to run it."""
    import torch

    cls, conf = model_class(class_name, config)
    dt = getattr(torch, dtype_name(dtype))
    if not weights:
        return _fake_build(cls, conf, dt)
    n = _param_count(cls, conf)
    need = n * torch.empty((), dtype=dt).element_size()
    have = _available_bytes()
    if have is not None and need > MEMORY_FRACTION * have:
        raise ProgramError(f"hf: {class_name} with this config has {n / 1e9:.2f} billion parameters, "
                           f"{need / 2**30:.1f} GiB in {dtype_name(dtype)}; this machine has {have / 2**30:.1f} GiB "
                           f"available and the model is built with its weights: use fewer layers or a smaller "
                           f"config, or import it without weights (weights=False; spmdkit plan does)")
    torch.manual_seed(seed)
    with _default_dtype(dt):
        model = cls(conf)
    model.eval()
    return model


def model_class(class_name: str, config: Any) -> tuple[Any, Any]:
    """(the transformers class ``class_name``, its config object made from ``config``)."""
    import torch

    tf = _transformers()
    cls = getattr(tf, class_name, None)
    cfg_cls = getattr(cls, "config_class", None)
    if isinstance(cls, type) and getattr(cls, "_model_mapping", None) is not None:
        raise ProgramError(f"hf: {class_name} is one of transformers' auto classes, which pick a model class by the "
                           f"config's model_type; give the model class itself"
                           f"{_own_class(cls, load_config(config))}")
    if cls is None or cfg_cls is None or not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise ProgramError(f"hf: transformers has no model class {class_name!r}")
    cfg = load_config(config)
    given = cfg.get("model_type")
    own = getattr(cfg_cls, "model_type", "")
    if isinstance(given, str) and own and given != own:  # another model's config: its keys would be dropped
        raise ProgramError(f"--hf-config: model_type {given[:40]!r} is not {class_name}'s ({cfg_cls.__name__}: "
                           f"{own!r}); the config is another model's, whose keys {cfg_cls.__name__} would drop"
                           f"{_own_class(None, cfg)}")
    cfg.pop("architectures", None)
    check_hf_config(cfg_cls, cfg, cls)  # one line naming the key for a bad config (models/hf_checks.py)
    try:
        conf = cfg_cls(**cfg)
    except (TypeError, ValueError) as exc:
        raise ProgramError(f"hf: {cfg_cls.__name__} rejects the config: {exc}") from None
    return cls, conf


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padded vocabulary: ``vocab`` rounded up to a multiple of ``divisible_by x tp``
    (``--make-vocab-size-divisible-by``, 128 by default, times the tensor-parallel size;
    ``megatron.training.vocab_utils.calculate_padded_vocab_size`` and
    ``megatron.core.tokenizers.utils.build_tokenizer.vocab_size_with_padding`` at d98e8a6)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def pad_vocab_config(class_name: str, config: Any, divisible_by: int, tp: int) -> tuple[dict[str, Any], int, int]:
    """(the config with its ``vocab_size`` padded as Megatron pads it (:func:`padded_vocab_size`),
    the vocabulary it had (given, or its config class's default), the padded one). The model built
    from it holds the padded rows as real parameters (its embedding and output layer, tied or not:
    both read ``vocab_size``), their logits in the softmax, as Megatron's; HF's own
    ``resize_token_embeddings(n, pad_to_multiple_of=m)`` makes the same shapes. ProgramError naming
    the flag for a config without a vocabulary."""
    cfg = load_config(config)
    _cls, conf = model_class(class_name, cfg)
    vocab = getattr(conf, "vocab_size", None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise ProgramError(f"--make-vocab-size-divisible-by: --hf {class_name}'s config has no vocab_size to pad")
    padded = padded_vocab_size(vocab, divisible_by, tp)
    cfg["vocab_size"] = padded
    if getattr(model_class(class_name, cfg)[1], "vocab_size", None) != padded:
        raise ProgramError(f"--make-vocab-size-divisible-by: --hf {class_name}'s config does not take its vocabulary "
                           f"from vocab_size; give the padded vocabulary ({padded}) in --hf-config")
    return cfg, vocab, padded


def _own_class(auto: Any, cfg: Mapping[str, Any]) -> str:
    """A hint naming the model class ``cfg`` is for: its ``architectures``, else the class the auto
    class ``auto`` maps its model_type to; empty where neither says."""
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs):
        return f" (the config's architectures: {', '.join(a[:60] for a in archs[:4])})"
    try:
        conf_cls = _transformers().CONFIG_MAPPING[cfg["model_type"]]
        return f" (model_type {cfg['model_type']!r}: {auto._model_mapping[conf_cls].__name__})"
    except Exception:  # no model_type, one transformers lacks, or no such head for it
        return ""


@contextlib.contextmanager
def _default_dtype(dt: Any) -> Iterator[None]:
    import torch

    old = torch.get_default_dtype()
    if dt.is_floating_point:
        torch.set_default_dtype(dt)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _fake_build(cls: Any, conf: Any, dt: Any) -> Any:
    """``cls(conf)`` in ``dt`` with every parameter a fake tensor (torch's FakeTensorMode: shape,
    dtype and device, no storage) and the buffers real. Parameters are made fake as they are
    registered, so no weight is ever allocated; ``torch.export`` traces the model with real
    inputs under the parameters' fake mode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    register = torch.nn.Module.register_parameter

    def fake_parameter(module: Any, name: str, param: Any) -> None:
        if param is not None and not isinstance(param, FakeTensor):
            with mode:
                fake = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
            param = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
            param._is_hf_initialized = True  # HF's weight initialisation skips it: nothing to fill
        register(module, name, param)

    torch.nn.Module.register_parameter = fake_parameter  # type: ignore[method-assign,assignment]
    try:
        with _default_dtype(dt):
            model = cls(conf)
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    model.eval()
    return model


def has_weights(model: Any) -> bool:
    """Whether ``model``'s parameters hold values (False for :func:`build`'s ``weights=False``)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(isinstance(p, FakeTensor) or p.is_meta for p in model.parameters())


#: ``build`` refuses a model whose parameters would take more than this share of the memory
#: available, instead of letting the operating system kill the process.
MEMORY_FRACTION = 0.5

#: ``import_hf(weights=None)`` builds the weights of a model up to this size (bytes in its
#: dtype), for ``spmdkit run`` and the simulator; a larger one is imported without them.
WEIGHTS_UP_TO = 256 * 2**20


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
                   ignored: float = 0.1, seed: int = 0, vocab: int | None = None) -> dict[str, Any]:
    """Keyword inputs for ``model`` in their valid ranges (see the module docstring); ``ignored``:
    the fraction of labels set to -100 (at least one label stays counted); ``pad``: padded
    positions (attention mask 0) at the end of the last row; ``vocab``: the tokenizer's vocabulary
    where the model's is padded (:func:`pad_vocab_config`): token ids and labels drawn below it, the
    padded rows never a token or a target. A speech encoder-decoder (Whisper:
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
    vocab = int(vocab or getattr(cfg, "vocab_size", 0) or 0)
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


@contextlib.contextmanager
def dynamic_rope_at(model: Any, seq: int) -> Iterator[None]:
    """HF's dynamic NTK rotary embedding (``rope_type`` "dynamic") recomputes its frequencies in
    each forward from the largest position id (``torch.max(position_ids) + 1`` against its cache,
    ``modeling_rope_utils.dynamic_rope_update``): a data-dependent branch ``torch.export`` cannot
    trace ('GuardOnDataDependentSymNode'). The traced step's positions are 0 .. seq - 1, so the
    update runs once here, eagerly at ``seq`` (the frequencies grown past
    ``max_position_embeddings``, or left as they are), and the trace reads them with the update
    off (``rope_type`` "default" while it traces): the values HF computes at that length."""
    import torch

    saved = []
    for mod in model.modules():
        rt = getattr(mod, "rope_type", None)
        kinds = {None: rt} if isinstance(rt, str) else dict(rt) if isinstance(rt, dict) else {}
        dyn = [lt for lt, k in kinds.items() if isinstance(k, str) and "dynamic" in k]
        if not dyn or not isinstance(mod, torch.nn.Module):
            continue
        buf = next(mod.buffers(), None)
        x = torch.zeros(1, device=buf.device if buf is not None else "cpu")
        pos = torch.arange(seq, device=x.device)[None]
        with torch.no_grad():
            for lt in dyn:
                mod(x, pos) if lt is None else mod(x, pos, layer_type=lt)
        saved.append((mod, rt))
        setattr(mod, "rope_type", "default" if isinstance(rt, str) else {**kinds, **dict.fromkeys(dyn, "default")})  # noqa: B010
    try:
        yield
    finally:
        for mod, rt in saved:
            setattr(mod, "rope_type", rt)  # noqa: B010


def import_hf(class_name: str, config: Any, *, batch: int = 2, seq: int = 16, dtype: str = "float32",
              training: bool = True, pad: int = 0, seed: int = 0, weights: bool | None = True,
              repeat: bool | None = None, moe: str | float | None = "auto",
              cp: tuple[int, str, str] | None = None, tp_chunks: int = 1, vocab: int | None = None, **opts: Any
              ) -> tuple[Any, Any, dict[str, Any]]:
    """``build`` + ``example_inputs`` + ``import_module``: (program, model, keyword inputs).

    ``weights``: True builds the weights (the model runs: ``torch_values``, ``spmdkit run``),
    False imports without them (:func:`build`'s fake parameters: any size), None builds them
    for a model of at most :data:`WEIGHTS_UP_TO` bytes and imports a larger one without them.
    ``repeat``: trace one layer of each kind and repeat it to the model's depth
    (:mod:`spmdkit.models.torch_import.layers`; the program is the full trace's); default: when
    imported without weights. ``moe``: the capacity of each expert of the MoE blocks (Mixtral,
    Qwen-MoE, DeepSeek-V3: lowered to the zoo's MoE ops, :mod:`spmdkit.models.torch_import.moe`):
    ``"auto"`` is ``"dropless"`` (every token of a sequence: the module's own values, as ``spmdkit
    run`` compares them) where ``weights`` is True, else ``"uniform"`` (the zoo's and the catalog's
    ``ceil(seq x top_k / experts)``: the plan of the step as MoE frameworks size it); a float is a
    capacity factor; None imports the blocks as HF computes them. ``cp``: (ranks, variant, balance)
    of context parallelism: the call traced in the cp ranks' token order with ``cp_attention``
    (:mod:`spmdkit.models.hf_cp`; the keyword inputs returned are that call's, torch eager's the
    program's ``eager_kwargs``), its MoE blocks routed in ``cp`` chunks of the sequence, one a
    cp rank (the capacity per chunk), as the zoo's are. ``tp_chunks``: each sequence (under cp each
    cp rank's share) routed in that many chunks more, one a tp rank (``--strategy
    megatron,sp,ep,etp=1``: Megatron's ETP = 1 token path, each tp rank routing its own sequence
    shard; :func:`spmdkit.strategies.experts.tp_chunks`). ``vocab``: the tokenizer's vocabulary of a
    padded one (:func:`example_inputs`). ``opts`` go to :func:`spmdkit.models.torch_import.import_module`
    (``fallback``, ``optimizer``, ...)."""
    from spmdkit.models.torch_import import cp_mapping, import_module

    if weights is None:
        model = build(class_name, config, dtype=dtype, seed=seed, weights=False)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        if size <= WEIGHTS_UP_TO:
            model = build(class_name, config, dtype=dtype, seed=seed)
    else:
        model = build(class_name, config, dtype=dtype, seed=seed, weights=weights)
    if repeat is None:
        repeat = not has_weights(model)
    kw = example_inputs(model, batch, seq, labels=training, pad=pad, seed=seed, vocab=vocab)
    natural, masked = kw, list[str]()
    if cp is not None:  # the tokens in the cp ranks' order, attention at their positions (models/hf_cp.py)
        kw, q_pos, k_pos = cp_call(model, kw, cp, pad)
        opts["mapping"] = {**(opts.get("mapping") or {}), **cp_mapping(q_pos, k_pos, cp[1], cp[2], masked)}
    chunks = (cp[0] if cp is not None else 1) * tp_chunks
    if tp_chunks > 1 and seq % chunks:
        raise ProgramError(f"--strategy megatron,sp,ep,etp=1: each rank routes its own tokens, the sequence of {seq} "
                           f"tokens split into {'cp x tp' if cp is not None else 'tp'} = {chunks} chunks; it does "
                           f"not split evenly")
    if chunks > 1:  # each cp (x tp) rank routes its own tokens (the zoo's moe_chunks)
        opts["moe_chunks"] = chunks
    if moe == "auto":
        moe = "dropless" if weights is True else "uniform"
    record = None
    with dynamic_rope_at(model, seq):
        if not pad:  # no padding: HF's sdpa mask is skipped as in eager mode (models/hf_attention.py)
            with unmasked_attention() as record:
                prog = import_module(model, (), kw, training=training, repeat_layers=repeat, moe=moe, fuse=True,
                                     **opts)
        if record is None or record.unsafe:
            prog = import_module(model, (), kw, training=training, repeat_layers=repeat, moe=moe, fuse=True, **opts)
    if chunks > 1:
        prog.moe_chunks_by = " x ".join(w for w, n in (("cp", cp[0] if cp is not None else 1), ("tp", tp_chunks))
                                        if n > 1)
    if cp is not None:
        check_cp(prog, model, record, masked)
        prog.eager_kwargs = natural
    note = attention_note(record, prog, seq, bool(pad))
    prog.notes += [note] if note else []
    return prog, model, kw


__all__ = ["MEMORY_FRACTION", "WEIGHTS_UP_TO", "build", "dtype_name", "dynamic_rope_at", "example_inputs", "has_weights", "import_hf",
           "load_config", "model_class", "pad_vocab_config", "padded_vocab_size"]
