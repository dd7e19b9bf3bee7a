"""Vision: the test model (``harness.vision``) and llama.cpp's multimodal library in the build ``make`` installs.

The projector is built from a random Gemma 3-shaped vision stage and paired with the bundled SmolLM2; these tests
check what every later vision test stands on: the library is there, it loads the projector against the bundled
model, and an image becomes ``IMAGE_TOKENS`` embeddings that follow the image (the same image twice the same,
two different images apart).
"""

from __future__ import annotations

import ctypes
import io
from typing import Any

import pytest

pytestmark = pytest.mark.llama


def _png(color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (128, 128), color).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def mtmd() -> Any:
    import llama_cpp.mtmd_cpp as mt  # the Makefile refuses a build without it

    from backends.bundled import bundled_gguf_path
    from backends.llama.native import open_llama
    from harness.vision import vision_projector

    llm = open_llama(bundled_gguf_path(), n_ctx=512, n_threads=1)
    params = mt.mtmd_context_params_default()
    params.use_gpu = False
    params.print_timings = False
    params.n_threads = 1
    ctx = mt.mtmd_init_from_file(str(vision_projector()).encode(), llm.model, params)
    assert ctx, "mtmd refused the test projector"
    yield mt, ctx
    mt.mtmd_free(ctx)
    llm.close()


def _embeddings(mtmd: Any, data: bytes) -> list[float]:
    """The image's embeddings as mtmd computes them for its one image chunk."""
    mt, ctx = mtmd
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    bitmap = mt.mtmd_helper_bitmap_init_from_buf(ctx, buf, len(data), False)
    assert bitmap
    chunks = mt.mtmd_input_chunks_init()
    try:
        text = mt.mtmd_default_marker()
        inp = mt.mtmd_input_text()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = text, len(text), False, True
        assert mt.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), (mt.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        images = [c for c in (mt.mtmd_input_chunks_get(chunks, i) for i in range(mt.mtmd_input_chunks_size(chunks)))
                  if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE]
        assert len(images) == 1
        from harness.vision import IMAGE_TOKENS

        n = mt.mtmd_input_chunk_get_n_tokens(images[0])
        assert n == IMAGE_TOKENS
        assert mt.mtmd_encode_chunk(ctx, images[0]) == 0
        out = mt.mtmd_get_output_embd(ctx)
        return [out[i] for i in range(n * 576)]
    finally:
        mt.mtmd_input_chunks_free(chunks)
        mt.mtmd_bitmap_free(bitmap)


def test_an_image_becomes_embeddings_that_follow_it(mtmd: Any) -> None:
    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    first, again, other = _embeddings(mtmd, red), _embeddings(mtmd, red), _embeddings(mtmd, blue)
    assert any(abs(v) > 0.1 for v in first)  # not the zero projection an untrained checkpoint starts from
    assert max(abs(a - b) for a, b in zip(first, again, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(first, other, strict=True)) > 0.5
