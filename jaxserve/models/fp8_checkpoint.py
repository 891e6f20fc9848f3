"""FP8 checkpoints: an HF folder whose ``config.json`` has a ``quantization_config`` stores its
decoder layers' linear projections in FP8; this module reads that field (``weight_format``),
checks the tensors against it (``check_tensors``) and builds each projection's
``linear.Fp8Weight`` from them (``fp8_weight``).

Every format stores a projection ``P`` (``model.layers.N.self_attn.q_proj``, ...) as
``P.weight`` [out, in] float8_e4m3fn (safetensors ``F8_E4M3``), used as stored (never
requantized), ``P.weight_scale`` (float32, bfloat16 or float16) with ``w ~= weight * scale``,
and, where the format quantizes activations with a static scale, ``P.input_scale`` with
``x ~= x_q * input_scale``:

* ``quant_method: "compressed-tensors"`` (llm-compressor; its ``format: "float-quantized"``, or
  older releases' ``"naive-quantized"``, the same bytes; a dense ``sparsity_config`` is fine):
  one ``config_groups`` entry whose ``weights`` are ``num_bits: 8, type: float, symmetric``,
  ``strategy: channel`` (``weight_scale`` [out, 1]) or ``tensor`` (``weight_scale`` [1]), not
  dynamic; its ``input_activations`` ``num_bits: 8, type: float``, either ``strategy: token,
  dynamic: true`` (llm-compressor's FP8_DYNAMIC preset: no ``input_scale``) or ``strategy:
  tensor, dynamic: false`` (its FP8 preset: ``input_scale`` [1]). Source: the compressed-tensors
  package (``QuantizationArgs``, the FP8 and FP8_DYNAMIC presets, the float-quantized
  compressor).
* ``quant_method: "modelopt"``, ``quant_algo: "FP8"`` (NVIDIA ModelOpt's unified HF export):
  ``weight_scale`` and ``input_scale`` one per tensor ([] or [1]). Its older form, config.json
  without ``quantization_config`` beside ``hf_quant_config.json`` (``{"producer": {"name":
  "modelopt"}, "quantization": {"quant_algo": "FP8", ...}}``), reads the same (the HF folder
  loader hands it on as the ``quantization_config``). Source: ModelOpt's export and vLLM's
  ``ModelOptFp8Config``.
* ``quant_method: "fbgemm_fp8"`` (HF transformers' ``FbgemmFp8Config``): ``weight_scale``
  [out, 1], activations dynamic per token with each token's largest magnitude capped at
  ``activation_scale_ub``. Source: transformers' fbgemm_fp8 integration, vLLM's
  ``FBGEMMFp8Config``.

Choices, as vLLM makes them: a static ``input_scale`` is honoured (the activations are quantized
with that one scale); Q/K/V and gate/up are fused into one projection each, whose input scale is
the largest of its parts' (they read the same activations). Per-tensor weight scales become
per-channel ones (each part's scale on its rows), so the stored FP8 values stay as they are.
Embeddings, norms and the LM head are read in ``--dtype`` (the formats leave them unquantized:
``ignore``/``exclude_modules``/``modules_to_not_convert`` list ``lm_head``); a listing entry
that names a decoder projection is refused, naming it (vLLM reads such layers unquantized; here
every decoder projection of an FP8 checkpoint is FP8). Malformed fields, a non-finite
``activation_scale_ub`` and integer or other float8 tensors are refused, naming them.
"""

import dataclasses
import fnmatch
import math
import re
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxserve.models.linear import FP8_DTYPE, Fp8Weight

FLAG = "--quantization"
METHODS = ("compressed-tensors", "modelopt", "fbgemm_fp8")
_FP8 = np.dtype(FP8_DTYPE)
_SCALE_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
# Tensor names (last part) of quantization data: a checkpoint's tensors of these kinds must be
# ones its quantization_config declares, not left unread.
_QUANT_MARKS = ("scale", "zero_point", "packed")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint stores its decoder linear projections (hashable: a static jit argument).

    Attributes:
      method: the ``quant_method``, one of ``METHODS``.
      per_tensor: ``weight_scale`` one per tensor ([] or [1]); False: one per output channel
        ([out, 1] or [out]).
      static_input: a static per-tensor ``input_scale`` ([] or [1]); False: dynamic, per token.
      input_scale_ub: the cap of a token's largest magnitude (fbgemm's ``activation_scale_ub``).
      unquantized: (key, entry) of the ``quantization_config`` listings of modules left
        unquantized (``lm_head`` as a rule; ``check_tensors`` refuses one naming a decoder
        projection).
    """

    method: str
    per_tensor: bool
    static_input: bool
    input_scale_ub: float | None = None
    unquantized: tuple[tuple[str, str], ...] = ()


def resolve_method(hf_config: dict, quantization: str | None) -> str | None:
    """The quantization method the engine runs: the checkpoint's ``quant_method`` when
    ``--quantization`` is unset or names the same, else the flag's ("fp8": quantized at load).

    Raises:
      ValueError: a ``quant_method`` outside ``METHODS``; a flag that differs from the
        checkpoint's method, or names a checkpoint method for a checkpoint without one (the
        message names the flag and the field).
    """
    qc = _object(hf_config.get("quantization_config"), "quantization_config", none_ok=True)
    method = None if qc is None else qc.get("quant_method")
    if qc is not None and method not in METHODS:
        raise ValueError(f"unsupported quantization_config.quant_method {method!r} (FP8 "
                         f"checkpoints: {', '.join(METHODS)})")
    if method is None:
        if quantization in METHODS:
            raise ValueError(f"{FLAG} {quantization} needs a checkpoint of that method; this one "
                             f"has no quantization_config")
        return quantization
    if quantization not in (None, method):
        raise ValueError(f"{FLAG} {quantization} conflicts with the checkpoint's "
                         f"quantization_config.quant_method {method!r}: leave {FLAG} unset or "
                         f"pass {method}")
    return method


def weight_format(hf_config: dict, quantization: str | None) -> "str | Fp8Checkpoint | None":
    """The format the linear projections are built in: None (``--dtype``), "fp8" (quantized at
    load, ``linear.quantize_weight``) or the checkpoint's ``Fp8Checkpoint``.

    Raises:
      ValueError: as ``resolve_method``; a scheme of the checkpoint's method that is not FP8
        W8A8 as the module docstring lists (int8, 4 bits, group or block scales, dynamic
        per-tensor activations, weight-only, KV cache scales, ...), naming the field.
    """
    method = resolve_method(hf_config, quantization)
    if method not in METHODS:
        return method
    qc = hf_config["quantization_config"]
    fmt = {"compressed-tensors": _compressed_tensors, "modelopt": _modelopt,
           "fbgemm_fp8": _fbgemm}[method](qc)
    return dataclasses.replace(fmt, unquantized=_unquantized(qc, method))


# Per format: the quantization_config keys that list modules left unquantized, and how an
# entry names a module: compressed-tensors a name, its last part or "re:" a regex from the
# start; ModelOpt an fnmatch pattern; transformers' fbgemm_fp8 any part of the name.
_UNQUANTIZED = {
    "compressed-tensors": (("ignore",), lambda e, n: (re.match(e[3:], n) is not None
                                                      if e.startswith("re:")
                                                      else n == e or n.endswith("." + e))),
    "modelopt": (("exclude_modules", "ignore"), lambda e, n: fnmatch.fnmatchcase(n, e)),
    "fbgemm_fp8": (("modules_to_not_convert",), lambda e, n: e in n),
}


def _unquantized(qc: dict, method: str) -> tuple[tuple[str, str], ...]:
    """(key, entry) of the format's listings of modules left unquantized.

    Raises:
      ValueError: a listing that is not a list of names, naming the key.
    """
    q = qc.get("quantization", qc) if method == "modelopt" else qc
    out = []
    for key in _UNQUANTIZED[method][0]:
        entries = q.get(key) or []
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ValueError(f"unsupported quantization_config.{key} {entries!r} (a list of "
                             f"module names)")
        out += [(key, e) for e in entries]
    return tuple(out)


def _object(value, where: str, none_ok: bool = False):
    """``value`` if it is a JSON object (or None where ``none_ok``)."""
    if (value is None and none_ok) or isinstance(value, dict):
        return value
    raise ValueError(f"unsupported {where} {value!r} (a JSON object)")


def _require(cfg: dict, key: str, allowed: tuple, where: str):
    """``cfg[key]`` if it is one of ``allowed`` (a missing key reads None)."""
    value = cfg.get(key)
    if value not in allowed:
        raise ValueError(f"unsupported {where}.{key} {value!r} (supported: "
                         f"{', '.join(map(repr, allowed))})")
    return value


def _compressed_tensors(qc: dict) -> Fp8Checkpoint:
    where = "quantization_config"
    for key in ("kv_cache_scheme", "transform_config"):
        _require(qc, key, (None, {}), where)
    sparsity = qc.get("sparsity_config")
    if sparsity not in (None, {}) and not (isinstance(sparsity, dict) and (
            sparsity.get("format") == "dense" or not sparsity.get("targets"))):
        raise ValueError(f"unsupported {where}.sparsity_config {sparsity!r} (dense weights)")
    groups = _object(qc.get("config_groups") or {}, f"{where}.config_groups")
    if len(groups) != 1:
        raise ValueError(f"unsupported {where}.config_groups: {len(groups)} groups (one FP8 "
                         f"scheme for every linear projection is supported)")
    (name, group), = groups.items()
    group = _object(group, f"{where}.config_groups.{name}")
    # FP8 values stored as they are: "naive-quantized" (older llm-compressor) is the same bytes.
    formats = ("float-quantized", "naive-quantized")
    _require(qc if qc.get("format") is not None else group, "format", formats,
             where if qc.get("format") is not None else f"{where}.config_groups.{name}")
    where = f"{where}.config_groups.{name}"
    _require(group, "format", (None, *formats), where)
    _require(group, "output_activations", (None,), where)
    w, x = group.get("weights"), group.get("input_activations")
    for args, key in ((w, "weights"), (x, "input_activations")):
        if not isinstance(args, dict):
            raise ValueError(f"unsupported {where}.{key} {args!r} (FP8 W8A8 quantizes both "
                             f"weights and input activations)")
        _require(args, "num_bits", (8,), f"{where}.{key}")
        _require(args, "type", ("float",), f"{where}.{key}")
        _require(args, "symmetric", (None, True), f"{where}.{key}")
        _require(args, "group_size", (None,), f"{where}.{key}")
        _require(args, "block_structure", (None,), f"{where}.{key}")
    strategy = _require(w, "strategy", ("channel", "tensor"), f"{where}.weights")
    _require(w, "dynamic", (None, False), f"{where}.weights")
    x_strategy = _require(x, "strategy", ("token", "tensor"), f"{where}.input_activations")
    # token scales are computed at run time, tensor ones read from the checkpoint.
    _require(x, "dynamic", (x_strategy == "token",), f"{where}.input_activations")
    return Fp8Checkpoint("compressed-tensors", per_tensor=strategy == "tensor",
                         static_input=x_strategy == "tensor")


def _modelopt(qc: dict) -> Fp8Checkpoint:
    # config.json's form, or hf_quant_config.json's with its fields under "quantization".
    where, q = (("hf_quant_config.json quantization", qc["quantization"])
                if "quantization" in qc else ("quantization_config", qc))
    q = _object(q, where)
    if str(q.get("quant_algo")).upper() != "FP8":
        raise ValueError(f"unsupported {where}.quant_algo {q.get('quant_algo')!r} "
                         f"(supported: 'FP8')")
    for key in ("kv_cache_quant_algo", "kv_cache_scheme"):
        _require(q, key, (None,), where)
    return Fp8Checkpoint("modelopt", per_tensor=True, static_input=True)


def _fbgemm(qc: dict) -> Fp8Checkpoint:
    ub = qc.get("activation_scale_ub")
    if not isinstance(ub, int | float) or isinstance(ub, bool) or not math.isfinite(ub) or ub <= 0:
        raise ValueError(f"unsupported quantization_config.activation_scale_ub {ub!r} (a "
                         f"positive number)")
    return Fp8Checkpoint("fbgemm_fp8", per_tensor=False, static_input=False,
                         input_scale_ub=float(ub))


def _projections(layer_shapes: dict) -> dict:
    """{projection name under ``model.layers.N.``: its output rows} of a layer's HF shapes."""
    return {name.removesuffix(".weight"): shape[0] for name, shape in layer_shapes.items()
            if name.endswith("_proj.weight")}


def scale_tensors(fmt: Fp8Checkpoint, layer_shapes: dict) -> dict:
    """{name under ``model.layers.N.``: the shapes it may have} of a layer's scale tensors."""
    one = ((), (1,))
    out = {}
    for proj, rows in _projections(layer_shapes).items():
        out[f"{proj}.weight_scale"] = one if fmt.per_tensor else ((rows, 1), (rows,))
        if fmt.static_input:
            out[f"{proj}.input_scale"] = one
    return out


def check_tensors(weights: dict, fmt, layer_shapes: dict, num_layers: int) -> None:
    """Check a checkpoint's FP8 data against ``fmt`` (``weight_format``'s) before any is read:
    with an ``Fp8Checkpoint``, every decoder projection's weight is float8_e4m3fn and its
    scales are there in the format's shapes and a float dtype; whatever ``fmt``, no other
    tensor is FP8 and no quantization tensor (``*scale``, ``*zero_point``, ``*packed``) is
    left unread.

    Args:
      weights: HF name -> host array or ``LazyTensor`` (shape and dtype are read, not values).
      layer_shapes: {name under ``model.layers.N.``: shape} (``llama.hf_tensor_shapes``).

    Raises:
      ValueError: naming the first tensor that is missing, of the wrong shape or dtype, or
        unexpected; or the ``fmt.unquantized`` entry that names a decoder projection.
    """
    fp8, scales = set(), {}
    if isinstance(fmt, Fp8Checkpoint):
        per_layer = scale_tensors(fmt, layer_shapes)
        names = _UNQUANTIZED[fmt.method][1]
        for i in range(num_layers):
            prefix = f"model.layers.{i}."
            for proj in _projections(layer_shapes):
                # every decoder projection of an FP8 checkpoint is read as FP8 here
                listed = next(((k, e) for k, e in fmt.unquantized if names(e, prefix + proj)),
                              None)
                if listed is not None:
                    raise ValueError(f"unsupported quantization_config.{listed[0]} entry "
                                     f"{listed[1]!r}: it leaves {prefix + proj} unquantized")
                fp8.add(f"{prefix}{proj}.weight")
            scales |= {prefix + name: shapes for name, shapes in per_layer.items()}
    for name in sorted(fp8):
        if name in weights and weights[name].dtype != _FP8:
            raise ValueError(f"tensor {name} has dtype {weights[name].dtype}, expected "
                             f"float8_e4m3fn ({fmt.method} checkpoint)")
    for name, shapes in sorted(scales.items()):
        w = weights.get(name)
        if w is None:
            raise ValueError(f"checkpoint lacks tensor {name!r} ({fmt.method} checkpoint)")
        if tuple(w.shape) not in shapes:
            raise ValueError(f"tensor {name} has shape {tuple(w.shape)}, expected "
                             f"{' or '.join(map(str, shapes))}")
        if w.dtype not in _SCALE_DTYPES:
            raise ValueError(f"tensor {name} has dtype {w.dtype}, expected a float dtype")
    for name, w in weights.items():
        last = name.rsplit(".", 1)[-1]
        if w.dtype.kind in "iub" or (w.dtype.name.startswith("float8") and w.dtype != _FP8):
            raise ValueError(f"tensor {name} has dtype {w.dtype}: quantized data the "
                             f"checkpoint's quantization_config does not declare as FP8 "
                             f"(unsupported)")
        if w.dtype == _FP8 and name not in fp8:
            raise ValueError(f"tensor {name} is float8_e4m3fn, but only the decoder layers' "
                             f"linear projections of an FP8 checkpoint may be")
        if any(mark in last for mark in _QUANT_MARKS) and name not in scales:
            raise ValueError(f"tensor {name} is quantization data the checkpoint's "
                             f"quantization_config does not declare (unsupported)")


def fp8_weight(fmt: Fp8Checkpoint, t: dict, proj: str) -> Fp8Weight:
    """Projection ``proj``'s checkpoint tensors (in ``t``, names under ``model.layers.N.``,
    checked by ``check_tensors``) -> its ``Fp8Weight``: the weight as stored, the scale on each
    of its rows in float32, the input scale in float32 (static formats), the format's cap."""
    weight = t[f"{proj}.weight"]
    scale = jnp.broadcast_to(t[f"{proj}.weight_scale"].reshape(-1).astype(jnp.float32),
                             weight.shape[:1])
    input_scale = (t[f"{proj}.input_scale"].reshape(()).astype(jnp.float32)
                   if fmt.static_input else None)
    return Fp8Weight(weight, scale, input_scale, fmt.input_scale_ub)
