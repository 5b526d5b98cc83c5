"""Edits to an exported ONNX file that make it a phone-ready edge model (onnx only; no torch).

* :func:`finalize`: metadata, the default thresholds made a constant of the graph, ``model_version``
  / producer set, exporter annotations stripped, only the opset domains in use.
* :func:`fix_batch_size`: a copy with the batch dimension fixed (NNAPI and CoreML take only
  fixed shapes; the ``.ort`` files are converted from such a copy).

The exporters trace the model with ``thresholds`` as a second input (so neither folds nor renames
it); :func:`finalize` then makes it an initializer that is not a graph input: a constant. Contract 2
left it in the inputs as well, which made it optional (the initializer its default, overridable),
but onnxruntime logs "Initializer thresholds appears in graph inputs and will not be treated as
constant value/weight" on every load of such a model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .edge_label import EDGE_FORMAT_VERSION, INPUT_NAMES, THRESHOLDS

PRODUCER_NAME = "fedml_ssfl.mobile_export"


def _producer_version() -> str:
    from fedml_ssfl import __version__

    return str(__version__)


def _nodes(graph) -> Iterator:
    """Every node of ``graph`` and of its subgraphs (If / Loop / Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _nodes(attr.g)
            for sub in attr.graphs:
                yield from _nodes(sub)


def domains_in_use(model) -> set[str]:
    """Operator domains the model's nodes (graph, subgraphs, local functions) use; ``""`` is ai.onnx."""
    used = {"" if n.domain == "ai.onnx" else n.domain for n in _nodes(model.graph)}
    for fn in model.functions:
        used.add(fn.domain)
        used.update("" if n.domain == "ai.onnx" else n.domain for n in fn.node)
    return used | {""}


def prune_opset_imports(model) -> list[str]:
    """Drop ``opset_import`` entries for domains no node uses (the default domain always stays).

    Returns the dropped domains. The quantizer declares every domain onnxruntime knows (8 of
    them) though the QDQ graph uses standard ONNX operators only.
    """
    used = domains_in_use(model)
    keep = [o for o in model.opset_import if ("" if o.domain == "ai.onnx" else o.domain) in used]
    dropped = sorted(o.domain for o in model.opset_import if o not in keep)
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return dropped


def make_constant(model, name: str, values: np.ndarray) -> None:
    """Make ``name`` a constant of the graph holding ``values``: an initializer, and no longer a graph input.

    ``name`` may be a graph input (as traced) or already such a constant (a file finalized before,
    e.g. the float model the int8 one is quantized from); its values are replaced either way.
    """
    from onnx import numpy_helper

    if not any(v.name == name for v in (*model.graph.input, *model.graph.initializer)):
        raise ValueError(f"the graph has no input or initializer named {name!r} to make a constant")
    inputs = [i for i in model.graph.input if i.name != name]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    kept = [t for t in model.graph.initializer if t.name != name]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.float32), name))


def finalize(
    path: str | Path, props: dict[str, str], default_thresholds, doc: str, graph_name: str | None = None
) -> dict[str, object]:
    """Rewrite the ONNX file at ``path`` as a versioned edge model; return what was done.

    Sets ``metadata_props`` to ``props``, makes ``default_thresholds`` the graph's constant
    ``thresholds`` (:func:`make_constant`), sets ``model_version`` (the edge contract version), producer name and
    version and the doc string, strips the exporter's annotations on nodes and values (stack
    traces with build-machine paths), and prunes ``opset_import`` to the domains in use.
    """
    import onnx

    model = onnx.load(str(path))
    for node in _nodes(model.graph):
        del node.metadata_props[:]
        node.doc_string = ""
    for value in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        del value.metadata_props[:]  # the exporter's pkg.torch.* annotations
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, props)
    make_constant(model, THRESHOLDS, np.asarray(default_thresholds, dtype=np.float32))
    model.model_version = EDGE_FORMAT_VERSION
    model.producer_name = PRODUCER_NAME
    model.producer_version = _producer_version()
    model.doc_string = doc
    if graph_name:
        model.graph.name = graph_name
    dropped = prune_opset_imports(model)
    onnx.save(model, str(path))
    return {
        "model_version": EDGE_FORMAT_VERSION,
        "opset_domains_dropped": dropped,
        "opset_import": {o.domain or "ai.onnx": int(o.version) for o in model.opset_import},
    }


def fix_batch_size(src: str | Path, dst: str | Path, batch_size: int) -> Path:
    """Write a copy of ``src`` whose ``images`` batch dimension is ``batch_size`` (outputs follow).

    Uses onnxruntime's own helpers (``python -m onnxruntime.tools.make_dynamic_shape_fixed``);
    the ``input_shape`` metadata of the copy says the fixed batch.
    """
    import onnx
    from onnxruntime.tools.onnx_model_utils import fix_output_shapes, make_input_shape_fixed

    model = onnx.load(str(src))
    images = next(i for i in model.graph.input if i.name == INPUT_NAMES[0])
    shape = [batch_size] + [d.dim_value for d in images.type.tensor_type.shape.dim[1:]]
    make_input_shape_fixed(model.graph, INPUT_NAMES[0], shape)
    fix_output_shapes(model)
    for prop in model.metadata_props:
        if prop.key == "input_shape":
            prop.value = json.dumps(shape)
    onnx.save(model, str(dst))
    return Path(dst)
