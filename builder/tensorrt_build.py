"""The TensorRT side of ``builder/build_engine.py``: the optimization profiles, the checks a
step graph must pass before TensorRT builds it, and the strongly typed build itself.

The step graph states every type (``export.build_step_graph``: float16 weights, pools and
activations in an fp16 engine, float32 where the model computes in float32), so the network
is built **strongly typed**: TensorRT 10 with ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``,
TensorRT 11 always (the flag is deprecated there, every network is strongly typed). No
precision flag is set (``BuilderFlag.FP16`` / ``BF16`` are deprecated in 10 and gone in 11):
TensorRT runs each layer in the type the graph gives it, inserts no casts of its own (which
around a plugin would cast whole pools and undo KVAppend's in-place write) and the plugins are
asked for the graph's types. ``PreviewFeature.ALIASED_PLUGIN_IO_10_03`` lets KVAppend's outputs
alias its input pools (in place); the TensorRT backend checks at run time that they do
(``runtime.engine.layers_not_appended_in_place``).

Every enum member used here exists in the TensorRT 10.16 and 11.1 headers; the tests run this
module against a stand-in ``tensorrt`` whose enums are those headers' (checked against
``NvInfer*.h`` when ``TRT_INCLUDE_DIR`` is set).
"""

from __future__ import annotations

from pathlib import Path

from tieredkv.errors import EngineBuildError, TopKLimitError

__all__ = ["TRT_MIN_VERSION", "build_tensorrt", "check_plugin_layers", "check_tensorrt_version",
           "check_topk_limit", "network_flags", "plugin_nodes", "tensorrt_profiles"]

#: the oldest TensorRT whose ONNX parser maps a node carrying ``plugin_namespace`` /
#: ``plugin_version`` to its registered plugin (older parsers inline the function body silently)
TRT_MIN_VERSION = "10.7"


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) if x.isdigit() else 0 for x in v.split(".")[:3])


def check_tensorrt_version(version: str) -> None:
    """EngineBuildError unless ``version`` (tensorrt.__version__) is at least TRT_MIN_VERSION."""
    if _version_key(version) < _version_key(TRT_MIN_VERSION):
        raise EngineBuildError(f"TensorRT {version} is too old: the tieredkv plugins need TensorRT >= "
                               f"{TRT_MIN_VERSION}, whose ONNX parser maps the plugin nodes to the registered plugins "
                               "(older parsers inline the nodes' function bodies without a word)")


def tensorrt_profiles(config, *, page_size: int, max_batch: int, max_context: int, prefill_chunk: int,
                      tiered_kv: bool, warm_codec: str | None = None) -> dict[str, dict[str, list[list[int]]]]:
    """The two TensorRT optimization profiles of the step graph, as {profile: {input: [min,
    opt, max]}}: ``decode`` (T = 1) and ``prefill`` (T up to ``prefill_chunk``); B up to
    ``max_batch``, M up to the pages of ``max_context`` tokens, pools up to every page of the
    batch twice over (device pool plus the step's staged pages); warm pools (with
    ``warm_codec``) from one row up to every page of the batch."""
    L, kvh, d, p = config.num_layers, config.num_kv_heads, config.head_dim, page_size
    m_max = -(-max_context // p)
    c_max = 2 * max_batch * m_max
    b = (1, max(1, max_batch // 2), max_batch)
    m = (1, max(1, m_max // 2), m_max)
    c = (1, max(1, c_max // 2), c_max)
    out = {}
    for name, t in (("decode", (1, 1, 1)), ("prefill", (1, prefill_chunk, prefill_chunk))):
        def shape(*dims):  # dims: ints or (min, opt, max) triples
            return [[x if isinstance(x, int) else x[i] for x in dims] for i in range(3)]

        prof = {"input_ids": shape(b, t), "positions": shape(b, t), "seq_len": shape(b), "page_index": shape(b, m),
                "page_table": shape(L, b, m), "page_mask": shape(L, b, m), "write_slot": shape(L, b, t),
                "write_offset": shape(b, t)}
        if tiered_kv:
            prof.update(page_pinned=shape(b, m), page_tokens=shape(b, m), attend_pages=shape(b),
                        key_min=shape(L, b, m, kvh, d), key_max=shape(L, b, m, kvh, d), page_saliency=shape(L, b, m),
                        position_table=shape(L, (1, 16, 64)))  # the scorer's buckets (16 by default)
        if warm_codec is not None:
            from tieredkv.plugins.codec import CODECS, page_bytes

            nb = page_bytes(CODECS[warm_codec], kvh, p, d)
            w = (1, max(1, max_batch * m_max // 2), max_batch * m_max)
            prof["page_warm_row"] = shape(L, b, m)
        for layer in range(L):
            prof[f"k_pool_{layer}"] = prof[f"v_pool_{layer}"] = shape(c, kvh, p, d)
            if warm_codec is not None:
                prof[f"warm_pool_{layer}"] = shape(w, nb // 4)  # int32 words
        out[name] = prof
    return out


def check_topk_limit(*, max_context: int, page_size: int, max_attention_pages: int | None) -> int:
    """The largest K the tiered graph's SelectPages asks of TensorRT's TopK: the attention
    budget the engine is built for (``max_attention_pages``; None: every page of
    ``max_context``), at most the pages of ``max_context``. TopKLimitError when that is over
    TensorRT's limit (``TOPK_LIMIT`` = 3840), before anything is built."""
    from tieredkv.plugins.onnx_ops import TOPK_LIMIT

    pages = -(-max_context // page_size)
    if max_attention_pages is not None and max_attention_pages <= 0:
        raise EngineBuildError(f"--max-attention-pages must be a positive integer, got {max_attention_pages}")
    k = pages if max_attention_pages is None else min(pages, max_attention_pages)
    if k > TOPK_LIMIT:
        given = (f"--max-attention-pages {max_attention_pages}" if max_attention_pages is not None else
                 f"--max-context {max_context} at --page-size {page_size} ({pages} pages, the default budget bound)")
        raise TopKLimitError(
            f"{given}: SelectPages ranks up to {k} pages with one TensorRT TopK, whose K is at most {TOPK_LIMIT}. "
            f"Pass --max-attention-pages <= {TOPK_LIMIT} (the largest attention budget the engine will serve, "
            f"{TOPK_LIMIT * page_size} tokens at this page size; the runtime refuses a larger one), a larger "
            "--page-size, or a smaller --max-context")
    return k


def plugin_nodes(model) -> dict[str, str]:
    """The step graph's nodes that TensorRT must run as tieredkv plugins (those carrying
    ``plugin_namespace``): {node name: op type}."""
    from tieredkv.plugins.onnx_ops import DOMAIN

    return {node.name: node.op_type for node in model.graph.node
            if node.domain == DOMAIN and any(a.name == "plugin_namespace" for a in node.attribute)}


def _plugin_name(layer, trt) -> str | None:
    """The plugin name of a V3 plugin layer (its core capability's ``plugin_name``); None when
    this TensorRT's Python API does not expose the plugin of the layer."""
    try:
        cls = getattr(trt, "IPluginV3Layer", None)
        if cls is not None and not isinstance(layer, cls):
            layer.__class__ = cls  # get_layer returns the ILayer base (polygraphy downcasts the same way)
        getter = getattr(layer, "get_plugin", None)
        plugin = getter() if getter is not None else getattr(layer, "plugin", None)
        core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE) if plugin is not None else None
        return str(core.plugin_name) if core is not None else None
    except (AttributeError, TypeError):  # a Python API without these: the layer's name is the check
        return None


def check_plugin_layers(network, trt, expected: dict[str, str]) -> None:
    """After parsing: every plugin node of the step graph (``expected``: {node name: op type})
    must be a V3 plugin layer of that name (the ONNX parser names each layer after its node)
    whose plugin is that op. A parser that inlined a node's function body instead builds an
    engine that runs, slowly and without the plugins, and another plugin in its place is
    another op: both are build errors here, naming each node."""
    found: dict[str, str | None] = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.PLUGIN_V3 and layer.name in expected:
            found[layer.name] = _plugin_name(layer, trt)
    missing = {name: op for name, op in expected.items() if name not in found}
    wrong = {name: found[name] for name, op in expected.items() if name in found and found[name] not in (op, None)}
    if missing:
        raise EngineBuildError(
            f"the parsed network has no plugin layer for {len(missing)} of the {len(expected)} plugin nodes: "
            f"{_name_nodes(missing)}: TensorRT inlined their ONNX function bodies instead of using the tieredkv "
            f"plugins. Use TensorRT >= {TRT_MIN_VERSION} and load the tieredkv plugin library (--plugin-library)")
    if wrong:
        raise EngineBuildError("plugin layers run other plugins than their nodes' ops: " + "; ".join(
            f"{name} ({expected[name]}) runs {got}" for name, got in list(wrong.items())[:8]))


def _name_nodes(nodes: dict[str, str], per_op: int = 6) -> str:
    """{node: op} as "op xN: node, node, ... and k more; op ..." (every op, the first nodes of each)."""
    by_op: dict[str, list[str]] = {}
    for name, op in nodes.items():
        by_op.setdefault(op, []).append(name)
    return "; ".join(f"{op} x{len(names)}: {', '.join(names[:per_op])}"
                     + (f" and {len(names) - per_op} more" if len(names) > per_op else "")
                     for op, names in by_op.items())


def network_flags(trt) -> int:
    """The network creation flags of a strongly typed network: STRONGLY_TYPED on TensorRT 10;
    0 on TensorRT 11, where every network is strongly typed (the flag is deprecated)."""
    if _version_key(trt.__version__) >= (11,):
        return 0
    return 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)


def build_tensorrt(trt, onnx_path: Path, plan_path: Path, *, profiles: dict, plugin_library: Path | None,
                   tiered_kv: bool, log) -> int:
    """Build ``plan_path`` from the step graph ``onnx_path`` with the TensorRT module ``trt``
    (strongly typed; ``profiles`` from :func:`tensorrt_profiles`); returns the plan's bytes.
    EngineBuildError for a missing plugin library or creator, an old TensorRT or a network
    without the plugin layers; RuntimeError when TensorRT's parser or builder fails (its log
    says why)."""
    import onnx

    from tieredkv.plugins.onnx_ops import (IMPORTANCE_SCORE, KV_APPEND, PLUGIN_NAMESPACE, PLUGIN_VERSION,
                                           TIERED_ATTENTION)

    check_tensorrt_version(trt.__version__)
    logger = trt.Logger(trt.Logger.WARNING)
    registry = trt.get_plugin_registry()
    if plugin_library is not None:
        if not plugin_library.is_file():
            raise EngineBuildError(f"{plugin_library}: plugin library not found")
        registry.load_library(str(plugin_library))
    ops = [TIERED_ATTENTION, KV_APPEND] + ([IMPORTANCE_SCORE] if tiered_kv else [])
    missing = [op for op in ops if registry.get_creator(op, PLUGIN_VERSION, PLUGIN_NAMESPACE) is None]
    if missing:
        raise EngineBuildError(f"TensorRT has no plugin creator for {missing} (namespace {PLUGIN_NAMESPACE!r}, version "
                               f"{PLUGIN_VERSION}); pass --plugin-library with the tieredkv plugin library")
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    # nodes carrying plugin_namespace / plugin_version become their registered plugins
    parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    if not parser.parse_from_file(str(onnx_path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejects {onnx_path.name}: {errs}")
    check_plugin_layers(network, trt, plugin_nodes(onnx.load(str(onnx_path), load_external_data=False)))
    cfg = builder.create_builder_config()
    # KVAppend writes the pools in place: its outputs alias its inputs (getAliasedInput)
    cfg.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    for prof_shapes in profiles.values():
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof_shapes.items():
            profile.set_shape(name, lo, opt, hi)
        cfg.add_optimization_profile(profile)
    log(f"      strongly typed network, {network.num_layers} layers, {len(profiles)} optimization profiles")
    serialized = builder.build_serialized_network(network, cfg)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the engine (see its log above)")
    data = bytes(serialized)
    plan_path.write_bytes(data)
    return len(data)
