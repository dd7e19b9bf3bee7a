"""A llama.cpp model's image encoder: a multimodal projector GGUF opened by llama.cpp's multimodal library (mtmd).

``LlamaVision`` gives the tape an image's block (``backends.tape.images.ImageBlock``: the text tokens the
projector wraps an image in, and how many embeddings it makes) and computes the block's embeddings into the
model's KV when the prefill reaches its positions. Images are decoded by Pillow (PNG, JPEG, WebP, GIF's first
frame) into RGB before mtmd sees them, so every format takes one path; mtmd resizes and encodes.

Only projectors whose image positions are one per embedding are served (llama.cpp's M-RoPE models, Qwen2-VL's
family, give an image fewer positions than embeddings, which the tape's one-position-per-token rule does not
hold); their load is refused with the reason.
"""

from __future__ import annotations

import ctypes
import io
from collections import OrderedDict
from pathlib import Path
from typing import Any

from contract.errors import Internal, InvalidArgument, ModelLoadFailed, UnsupportedFeature
from contract.types import ImageInput

from ..tape.images import ImageBlock
from .native import install_mtmd_log, log_mark, log_since

__all__ = ["MAX_PIXELS", "LlamaVision"]

#: the most pixels an image may have here (the HTTP front's limit is lower; this guards direct clients)
MAX_PIXELS = 64 * 1024 * 1024
#: images whose bytes are kept to compute their embeddings when their positions are prefilled; a request's
#: images are all registered just before its prefill, so this bounds memory, not what one request may send
_KEPT_IMAGES = 256
_KEPT_BLOCKS = 4096
#: the newest images' encoder inputs (mtmd's image chunk: the pixels resized and normalized, a few MB each for a
#: real projector), kept from reading an image's block to computing it, so a cold image is decoded once
_KEPT_CHUNKS = 4


def _rgb(data: bytes) -> tuple[int, int, bytes]:
    """The image's first frame as RGB bytes; InvalidArgument for what Pillow cannot read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > MAX_PIXELS:
                raise InvalidArgument(f"the image is {width}x{height} pixels; the model's encoder takes at most "
                                      f"{MAX_PIXELS:,}", width=width, height=height)
            img.seek(0)
            return width, height, img.convert("RGB").tobytes()
    except InvalidArgument:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InvalidArgument(f"the image could not be decoded: {exc}") from None


class LlamaVision:
    """The projector of a loaded llama.cpp model: image blocks for the tape, their embeddings into the KV.

    Everything runs on the daemon's worker thread, as the model's other calls do."""

    def __init__(self, path: Path, llm: Any, *, threads: int) -> None:
        import llama_cpp.mtmd_cpp as mt

        self._mt = mt
        self._llm = llm
        self.path = path
        install_mtmd_log()
        params = mt.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.n_threads = threads
        params.warmup = False
        mark = log_mark()
        ctx = mt.mtmd_init_from_file(str(path).encode(), llm.model, params)
        if not ctx:
            raise ModelLoadFailed(f"llama.cpp's multimodal library could not open the projector {path} for this "
                                  f"model{log_since(mark)}", mmproj=str(path))
        self._ctx = ctx
        try:
            if not mt.mtmd_support_vision(ctx):
                raise ModelLoadFailed(f"{path} is a projector without an image encoder (audio only?)",
                                      mmproj=str(path))
            if mt.mtmd_decode_use_mrope(ctx):
                raise ModelLoadFailed(f"{path}'s model places an image's embeddings at fewer positions than it "
                                      "has (M-RoPE: the Qwen2-VL family), which this daemon does not serve yet",
                                      mmproj=str(path))
        except BaseException:
            self.close()
            raise
        self.bytes = path.stat().st_size
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._blocks: OrderedDict[str, ImageBlock] = OrderedDict()
        self._by_first: dict[int, str] = {}
        self._chunks: OrderedDict[str, Any] = OrderedDict()

    def close(self) -> None:
        while self._chunks:
            self._mt.mtmd_input_chunk_free(self._chunks.popitem()[1])
        if self._ctx:
            self._mt.mtmd_free(self._ctx)
            self._ctx = None

    def _keep_chunk(self, digest: str, chunk: Any) -> None:
        """Keep a copy of the image's chunk for ``evaluate`` (the oldest beyond ``_KEPT_CHUNKS`` freed)."""
        copy = self._mt.mtmd_input_chunk_copy(chunk)
        if not copy:
            return
        old = self._chunks.pop(digest, None)
        if old is not None:
            self._mt.mtmd_input_chunk_free(old)
        self._chunks[digest] = copy
        while len(self._chunks) > _KEPT_CHUNKS:
            self._mt.mtmd_input_chunk_free(self._chunks.popitem(last=False)[1])

    # --- the tape's side ---------------------------------------------------------------------------------------
    def block(self, image: ImageInput) -> ImageBlock:
        """The image's block on the tape; the image is kept to be computed when the block is prefilled."""
        digest, data = image.digest, image.data
        self._data[digest] = data
        self._data.move_to_end(digest)
        while len(self._data) > _KEPT_IMAGES:
            self._data.popitem(last=False)
        found = self._blocks.get(digest)
        if found is None:
            found = self._read_block(digest, data)
            self._blocks[digest] = found
            self._by_first[found.first_embd] = digest
            while len(self._blocks) > _KEPT_BLOCKS:
                old, gone = self._blocks.popitem(last=False)
                self._by_first.pop(gone.first_embd, None)
        self._blocks.move_to_end(digest)
        return found

    def _read_block(self, digest: str, data: bytes) -> ImageBlock:
        chunks = self._tokenize(data)
        try:
            mt = self._mt
            before: list[int] = []
            after: list[int] = []
            n_embd = -1
            for i in range(mt.mtmd_input_chunks_size(chunks)):
                chunk = mt.mtmd_input_chunks_get(chunks, i)
                kind = mt.mtmd_input_chunk_get_type(chunk)
                if kind == mt.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    ids = mt.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    (before if n_embd < 0 else after).extend(int(ids[j]) for j in range(n.value))
                elif kind == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE and n_embd < 0:
                    n_embd = int(mt.mtmd_input_chunk_get_n_tokens(chunk))
                    if int(mt.mtmd_input_chunk_get_n_pos(chunk)) != n_embd:
                        raise UnsupportedFeature("this model places an image's embeddings at fewer positions than "
                                                 "it has, which this daemon does not serve yet")
                    self._keep_chunk(digest, chunk)
                else:
                    raise Internal("llama.cpp's multimodal library made an image into other chunks than one image")
            if n_embd <= 0:
                raise Internal("llama.cpp's multimodal library made no image chunk of an image")
            return ImageBlock(digest, tuple(before), n_embd, tuple(after))
        finally:
            self._mt.mtmd_input_chunks_free(chunks)

    def _tokenize(self, data: bytes) -> Any:
        """mtmd's chunks of the one image alone (its marker as the whole text): caller frees them."""
        mt = self._mt
        width, height, rgb = _rgb(data)
        buf = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
        bitmap = mt.mtmd_bitmap_init(width, height, buf)
        if not bitmap:
            raise Internal("llama.cpp's multimodal library refused an RGB bitmap")
        chunks = mt.mtmd_input_chunks_init()
        try:
            marker = mt.mtmd_default_marker()
            text = mt.mtmd_input_text()
            text.text, text.text_len, text.add_special, text.parse_special = marker, len(marker), False, True
            mark = log_mark()
            rc = mt.mtmd_tokenize(self._ctx, chunks, ctypes.byref(text), (mt.mtmd_bitmap_p_ctypes * 1)(bitmap), 1)
            if rc != 0:
                raise InvalidArgument(f"the model's image encoder refused the image (mtmd_tokenize: {rc})"
                                      f"{log_since(mark)}")
            return chunks
        except BaseException:
            mt.mtmd_input_chunks_free(chunks)
            raise
        finally:
            mt.mtmd_bitmap_free(bitmap)

    # --- the KV's side -----------------------------------------------------------------------------------------
    def evaluate(self, first_id: int, n_past: int, n_batch: int, *, logits_last: bool) -> int:
        """Encode the image whose block's first placeholder is ``first_id`` and decode its embeddings into the
        KV from ``n_past``; the position after them. An aborted decode (a cancel) returns what llama.cpp said
        as a RuntimeError; the caller drops whatever part of the block reached the KV."""
        digest = self._by_first.get(first_id, "")
        data = self._data.get(digest)
        if data is None:
            raise Internal("an image block on the tape is not known to the image encoder any more")
        mt = self._mt
        kept = self._chunks.pop(digest, None)  # (None: read long ago; its image is decoded again)
        chunks = self._tokenize(data) if kept is None else None
        try:
            image = kept if chunks is None else next(
                c for c in (mt.mtmd_input_chunks_get(chunks, i) for i in range(mt.mtmd_input_chunks_size(chunks)))
                if mt.mtmd_input_chunk_get_type(c) == mt.MTMD_INPUT_CHUNK_TYPE_IMAGE)
            end = ctypes.c_int32(0)
            mark = log_mark()
            rc = mt.mtmd_helper_eval_chunk_single(self._ctx, self._llm.ctx, image, n_past, 0, n_batch, logits_last,
                                                  ctypes.byref(end))
            if rc != 0:
                raise RuntimeError(f"llama.cpp could not compute the image's embeddings ({rc}){log_since(mark)}")
            return int(end.value)
        finally:
            if kept is not None:
                mt.mtmd_input_chunk_free(kept)
            if chunks is not None:
                mt.mtmd_input_chunks_free(chunks)
