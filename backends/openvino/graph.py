"""The paged-attention graph: the IR rewritten so its KV block pools are inputs we own, and shape buckets."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import openvino as ov
import openvino.opset13 as ov_ops
from openvino._offline_transformations import paged_attention_transformation

from contract.errors import ModelLoadFailed

if TYPE_CHECKING:
    from ..readouts import Readouts

__all__ = [
    "EXACT_STEP_ROWS",
    "MIN_PREFILL_ROWS",
    "VERIFY_ROWS",
    "WARM_BUCKETS_UP_TO",
    "BATCH_GRAPH_MAX_WEIGHTS",
    "bucket",
    "paged_model",
    "verify_rows",
    "wants_batch_graph",
]

#: the CPU plugin computes chunks of 1..4 tokens (bf16; 1 token under f32) with other kernels
#: whose rounding differs; prefill chunks are padded to at least this many rows so every
#: prompt token is computed the same way (and this is the smallest shape bucket)
MIN_PREFILL_ROWS = 16
#: (up to this many rows, round up to a multiple of this) — see "Shape buckets" in ``backends.openvino.model``
_BUCKET_STEPS = ((256, 16), (1024, 64), (1 << 62, 256))
#: the largest bucket run at load: a chat turn's usual suffix. Warming costs each bucket's full rows (~0.9 ms a
#: row here, 2.3 s for every bucket to 256 and the 512-row chunk, 40% of a load of the bundled model), where a
#: bucket's first use pays 25-110 ms once (measured: 64 rows 25 ms, 256 rows 46 ms, 512 rows 108 ms)
WARM_BUCKETS_UP_TO = 64
#: a speculative draft's check runs padded to one of these row counts (compiled at load), so
#: drafts of every length share a few kernels instead of compiling one shape each
VERIFY_ROWS = (4, 8, 16)
#: with ``Config.exact_decode`` a decode step runs padded to the first of these row counts whose
#: logits equal a prefill's bit for bit, measured at load (``OpenVINOLoadedModel.warm_up``), else to
#: ``MIN_PREFILL_ROWS``, which a prefill uses itself. Which kernels a row count takes depends on the
#: CPU: here (AVX-512, no AMX) 2 rows already do, at 40 to 6,000 tokens of context, bf16 and f32;
#: on an AMX CPU chunks under 5 tokens were measured to round apart. Over a long past those kernels
#: cost more than a one-row step's: here a 2-row step is 1.05x a one-row step at 300 tokens of
#: context, ~1.4-1.85x at 2,000, ~1.6-2.5x at 4,000 (run to run), a 5-row one ~1.7x and ~1.85x
EXACT_STEP_ROWS = (2, 3, 4, 5, 8)
#: A second compiled copy of the graph (the batch graph) runs prefill chunks and draft checks,
#: so the first one only ever runs decode steps, when the model speculates and its weights are at
#: most this many bytes. The CPU plugin prepares every node again whenever an infer request's row
#: count changes (two requests of one compiled model share its graph): ~4.5 ms each way here,
#: against a ~9 ms step of the bundled model, so a lone 16-row check cost 2.31 + 2 x 0.62 steps.
#: With a graph per role the change of row count measured 0.28 steps instead of 0.62. The copy
#: costs memory (160 MB for the bundled model's 92 MB of weights, after a 4k prefill and a decode;
#: counted as twice the weights, ``options.batch_graph_bytes``) while the ~4.5 ms is the same
#: whatever the model's size, so it pays on small models, whose steps are short (half a step of
#: the bundled model's), and not on one whose weights take a gigabyte.
BATCH_GRAPH_MAX_WEIGHTS = 256 * 1024 * 1024
_PAGED_INPUTS = frozenset(
    {
        "input_ids",
        "position_ids",
        "past_lens",
        "subsequence_begins",
        "block_indices",
        "block_indices_begins",
        "max_context_len",
        "sample_index",
    }
)

def paged_model(core: ov.Core, xml: Path) -> ov.Model:
    """The stateful IR rewritten to paged attention, with the LM head fed one chosen row.

    ``paged_attention_transformation`` (the pass openvino-genai's continuous-batching
    pipeline applies) turns every SDPA + KV variable pair into a PagedAttention op
    whose K/V block pools are model inputs. The head gathers the row named by a
    new ``sample_index`` input (the last real token of a padded chunk), as GenAI
    does: without it every prefill computes [tokens, vocab] logits.
    """
    model = core.read_model(str(xml))
    if not model.get_variables():
        raise ModelLoadFailed(f"{xml} is not a stateful LLM graph (it has no KV variables)")
    paged_attention_transformation(model)
    head = model.output("logits").get_node().input_value(0).get_node()
    while head.get_type_name() in ("Convert", "Multiply", "Divide", "Tanh", "Add"):
        head = head.input_value(0).get_node()
    if head.get_type_name() == "MatMul":
        # one row per step, or every row of a speculative draft's check
        index = ov_ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name="sample_index")
        index.output(0).get_tensor().set_names({"sample_index"})
        # the paged graph lays tokens out on axis 0
        row = ov_ops.gather(head.input_value(0), index, np.array(0, np.int64))
        head.input(0).replace_source_output(row.output(0))
        model.add_parameters([index])
        model.validate_nodes_and_infer_types()
    names = {i.get_any_name() for i in model.inputs}
    missing = sorted(_PAGED_INPUTS - names)
    if missing:
        raise ModelLoadFailed(f"{xml} did not convert to paged attention: inputs {missing} are missing")
    return model


def wants_batch_graph(speculative: bool, weights_bytes: int, device: str = "CPU") -> bool:
    """Whether a load compiles the batch graph (``BATCH_GRAPH_MAX_WEIGHTS``): only a model that drafts
    changes row count between steps, only a small one pays for the copy, and only the CPU plugin's
    cost of a change was measured (a GPU's memory is not spent on a guess)."""
    on_cpu = device.split(".")[0].upper() == "CPU"
    return speculative and on_cpu and 0 < weights_bytes <= BATCH_GRAPH_MAX_WEIGHTS


def bucket(n: int) -> int:
    """The padded row count a prefill chunk of ``n`` tokens runs with."""
    for limit, step in _BUCKET_STEPS:
        if n <= limit:
            return max(MIN_PREFILL_ROWS, -(-n // step) * step)
    raise AssertionError("the last bucket step has no limit")


def verify_rows(n: int) -> int:
    """The padded row count a draft check of ``n`` tokens runs with."""
    for rows in VERIFY_ROWS:
        if n <= rows:
            return rows
    return bucket(n)


#: the residual stream after decoder layer N (its input plus attention plus MLP) in the IRs openvino-genai builds
#: from a GGUF (``gguf_utils/building_blocks.cpp``): what llama.cpp calls ``l_out-N``
_LAYER_OUT = "model.layers.self_attn.add1.layer{}"


def layer_output(layer: int) -> str:
    """The friendly name of layer ``layer``'s output node (``_LAYER_OUT``)."""
    return _LAYER_OUT.format(layer)


def readout_name(layer: int) -> str:
    """The output a readout graph gives layer ``layer``'s readouts under (``add_readouts``)."""
    return f"readout.{layer}"


def add_readouts(model: ov.Model, readouts: Readouts) -> None:
    """Give ``model`` one more output per readout layer: that layer's residual stream times the manifest's
    ``[hidden_size, n_concepts]`` directions (``readout_name``), every row of a chunk. ModelLoadFailed when the IR
    has no such node for a layer, or its width is not the manifest's hidden size."""
    nodes = {op.get_friendly_name(): op for op in model.get_ordered_ops()}
    for layer in readouts.layers:
        node = nodes.get(layer_output(layer))
        if node is None:
            raise ModelLoadFailed(f"this IR has no output of layer {layer} that readouts know "
                                  f"({layer_output(layer)!r}): readouts serve IRs built from a GGUF",
                                  layer=layer)
        width = node.get_output_partial_shape(0)[-1]
        readouts.check(width.get_length() if width.is_static else None, None)
        directions = ov_ops.constant(readouts.matrices[layer])
        product = ov_ops.matmul(node.output(0), directions, False, False)
        product.output(0).get_tensor().set_names({readout_name(layer)})
        model.add_outputs([product.output(0)])
    model.validate_nodes_and_infer_types()

