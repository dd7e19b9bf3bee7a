"""Images in requests (``modeld/front/images.py``) and what a model can be asked for (``capabilities``).

The checks each image goes through (data URLs only, base64, count, bytes, the format, the pixels read from the
header before decoding, a whole decode) are tested on images Pillow writes here; then, through real daemon
processes on both engines with the official SDKs, a text model's answer to an image in each API's own error shape
(``vision_unsupported``, naming the model), the bad images refused the same way, and the daemon serving on;
``capabilities`` in ``/v1/models``, ``status`` and ``describe``.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
PIL = pytest.importorskip("PIL.Image")

from modeld.front.errors import ApiError  # noqa: E402
from modeld.front.images import IMAGE_MARK, ImageLimits, ImageRef, read_images, take_images  # noqa: E402
from tests.test_openai_front import Front  # noqa: E402

LIMITS = ImageLimits(max_images=4, max_bytes=64 * 1024, max_pixels=1024 * 1024)


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    PIL.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(raw).decode()


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG signature and header that claims ``width`` x ``height``, then one tiny compressed row: what a
    decompression bomb looks like before it is decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def refused(ref: ImageRef, limits: ImageLimits = LIMITS) -> ApiError:
    with pytest.raises(ApiError) as err:
        read_images([ref], limits)
    return err.value


# --- the checks, on their own --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, media", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                        ("GIF", "image/gif")])
def test_each_format_is_read_with_its_size_and_digest(fmt: str, media: str) -> None:
    raw = image_bytes(fmt, (9, 7))
    [img] = read_images([ImageRef("m[0]", url=data_url(raw, media))], LIMITS)
    assert (img.format, img.width, img.height, img.data) == (fmt.lower(), 9, 7, raw)
    [again] = read_images([ImageRef("m[1]", data=base64.b64encode(raw).decode(), media_type=media)], LIMITS)
    assert again.digest == img.digest and len(img.digest) == 64
    [other] = read_images([ImageRef("m[2]", url=data_url(image_bytes(fmt, (9, 7), (0, 0, 255)), media))], LIMITS)
    assert other.digest != img.digest


def test_base64_wrapped_over_lines_is_read() -> None:
    raw = image_bytes()
    wrapped = "\n".join(base64.encodebytes(raw).decode().split())
    [img] = read_images([ImageRef("m", data=wrapped, media_type="image/png")], LIMITS)
    assert img.data == raw


@pytest.mark.parametrize("url, code", [
    ("https://example.com/cat.png", "image_url_refused"),
    ("http://127.0.0.1/cat.png", "image_url_refused"),
    ("file:///etc/passwd", "invalid_image"),
    ("data:image/png,rawbytes", "invalid_image"),  # not base64
    ("data:text/plain;base64,aGVsbG8=", "invalid_image"),
    ("data:image/png;base64,@@@not-base64@@@", "invalid_image"),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "invalid_image"),
])
def test_a_bad_url_or_payload_is_refused_naming_the_field(url: str, code: str) -> None:
    err = refused(ImageRef("messages[1].content[0]", url=url))
    assert (err.status, err.code, err.param) == (400, code, "messages[1].content[0]")
    assert "messages[1].content[0]" in err.message


def test_a_truncated_image_is_refused_before_any_engine_sees_it() -> None:
    raw = image_bytes("PNG", (64, 64))
    err = refused(ImageRef("m", url=data_url(raw[: len(raw) // 2])))
    assert (err.status, err.code) == (400, "invalid_image") and "decoded" in err.message


def test_limits_on_count_bytes_and_pixels_are_413s() -> None:
    one = ImageRef("m", url=data_url(image_bytes()))
    with pytest.raises(ApiError) as err:
        read_images([one] * 5, LIMITS)
    assert (err.value.status, err.value.code, err.value.param) == (413, "too_many_images", "m")
    big = refused(ImageRef("m", url=data_url(image_bytes("PNG", (8, 8)))), ImageLimits(4, 20, 1024))
    assert (big.status, big.code) == (413, "image_too_large") and "--max-image-bytes" in big.message
    wide = refused(ImageRef("m", url=data_url(image_bytes("PNG", (2000, 600)))))
    assert (wide.status, wide.code) == (413, "image_too_large") and "2000x600" in wide.message


@pytest.mark.parametrize("side", [1500, 10_000, 20_000, 100_000])
def test_a_bomb_is_refused_from_its_header_without_decoding_it(side: int) -> None:
    """A 100-byte PNG that claims 2 million to 10 billion pixels: refused by its claimed size, before anything is
    decoded (which would allocate it): by the limit, or past Pillow's own guard (about 89 and 179 million pixels:
    a warning, here an error, then an error) by that."""
    raw = png_claiming(side, side)
    assert len(raw) < 200
    err = refused(ImageRef("m", url=data_url(raw)))
    assert (err.status, err.code) == (413, "image_too_large") and "pixels" in err.message


def test_the_websocket_messages_image_parts_are_taken_out_in_order() -> None:
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                             {"type": "image_url", "image_url": "data:image/gif;base64,BBBB"}]}]
    refs: list[ImageRef] = []
    kept = take_images(messages, refs)
    mark = {"type": "text", "text": IMAGE_MARK}  # where each sat, for ``place_images``
    assert kept[1]["content"] == [{"type": "text", "text": "what is this?"}, mark, mark] and kept[0] == messages[0]
    assert [(r.where, r.url[-4:]) for r in refs] == [("messages[1].content[1]", "AAAA"), ("messages[1].content[2]", "BBBB")]


# --- capabilities, from the template -------------------------------------------------------------------------
def test_capabilities_are_read_from_the_template() -> None:
    from backends.bundled import bundled_gguf_path
    from backends.gguf_file import gguf_scalars
    from backends.tape.loading import source_capabilities
    from backends.tape.templates import TEMPLATE_DIR
    from harness.fixtures import THINK_CHATML_TEMPLATE, TOOL_CHATML_TEMPLATE

    def of(name: str) -> list[str]:
        return source_capabilities((TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8"))

    assert source_capabilities(str(gguf_scalars(bundled_gguf_path())["tokenizer.chat_template"])) == ["text"]
    assert of("qwen3_coder") == ["text", "tools"]
    assert of("gpt_oss") == ["text", "tools", "reasoning"]  # its channels carry the reasoning
    assert of("deepseek_v3_1") == ["text", "reasoning"]  # thinking, and tools only in a history it renders
    assert of("gemma3") == ["text"]
    assert source_capabilities(THINK_CHATML_TEMPLATE) == ["text", "reasoning"]
    assert source_capabilities(TOOL_CHATML_TEMPLATE) == ["text", "tools", "reasoning"]
    assert source_capabilities("") == source_capabilities("{% if %}") == ["text"]  # none, or one that does not compile


# --- through a daemon -----------------------------------------------------------------------------------------
PNG = image_bytes()
USER = "Describe the picture in one word."


@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.llama),
                                        pytest.param("openvino", marks=pytest.mark.openvino)])
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    pytest.importorskip("llama_cpp" if request.param == "llama" else "openvino_genai")
    with Front(tmp_path_factory.mktemp(f"images-{request.param}"), "--num-ctx", "2048", "--max-image-bytes", "64KiB",
               backend=request.param) as f:
        yield f


def _model(front: Front) -> str:
    with front.daemon.client() as c:
        st = c.status()
    assert st.active is not None
    return st.active.model_name


def _serves_on(front: Front) -> None:
    out = front.sdk().chat.completions.create(model="m", max_tokens=2, temperature=0,
                                              messages=[{"role": "user", "content": "Say hi."}])
    assert out.choices[0].message.content is not None and out.usage is not None and out.usage.completion_tokens > 0


def test_a_text_model_refuses_an_image_in_chat_completions_naming_itself(front: Front) -> None:
    import openai

    name = _model(front)
    content = [{"type": "text", "text": USER}, {"type": "image_url", "image_url": {"url": data_url(PNG)}}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            front.sdk().chat.completions.create(model="m", max_tokens=4, stream=stream,
                                                messages=[{"role": "user", "content": content}])
        body = err.value.body
        assert isinstance(body, dict) and body["code"] == "vision_unsupported", body
        assert body["param"] == "messages[0].content[1]" and repr(name) in body["message"], body
    _serves_on(front)


def test_a_text_model_refuses_an_image_in_responses(front: Front) -> None:
    import openai

    content = [{"type": "input_text", "text": USER}, {"type": "input_image", "image_url": data_url(PNG)}]
    with pytest.raises(openai.BadRequestError) as err:
        front.sdk().responses.create(model="m", max_output_tokens=4, input=[{"role": "user", "content": content}])
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "vision_unsupported" and body["param"] == "input[0].content[1]"
    with pytest.raises(openai.BadRequestError) as err:  # a file_id: there are no files to name
        front.sdk().responses.create(model="m", max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-123"}]}])
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "invalid_image"
    _serves_on(front)


def test_a_text_model_refuses_an_image_in_messages_in_anthropics_shape(front: Front) -> None:
    import anthropic

    name = _model(front)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}}
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{front.port}", api_key="none", max_retries=0,
                             timeout=600) as client:
        for messages in (
            [{"role": "user", "content": [image, {"type": "text", "text": USER}]}],
            # Claude Code's Read tool answers an image file with an image inside its tool_result
            [{"role": "user", "content": "Look at shot.png"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                                "input": {"path": "shot.png"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]}],
        ):
            with pytest.raises(anthropic.BadRequestError) as err:
                client.messages.create(model="m", max_tokens=4, messages=messages)  # type: ignore[arg-type]
            body: Any = err.value.body
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert body["error"]["code"] == "vision_unsupported", body  # (beside Anthropic's fixed types)
            assert "reads text only" in body["error"]["message"] and repr(name) in body["error"]["message"]
            with pytest.raises(anthropic.BadRequestError) as err:  # the count too: an image is not counted as nothing
                client.messages.count_tokens(model="m", messages=messages)  # type: ignore[arg-type]
            assert err.value.body["error"]["code"] == "vision_unsupported"  # type: ignore[index]
        url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [url_image]}])
        assert "does not fetch image URLs" in str(err.value.body)
    _serves_on(front)


def test_bad_images_are_refused_before_the_model_is_asked(front: Front) -> None:
    """A bad image is the client's mistake whatever the model: each is its own 400 or 413, and the daemon serves
    on. (``--max-image-bytes 64KiB`` here.)"""
    import openai

    def ask(url: str) -> Any:
        with pytest.raises((openai.BadRequestError, openai.APIStatusError)) as err:
            front.sdk().chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}])
        return err.value

    for url, status, code in [
        (data_url(png_claiming(50_000, 50_000)), 413, "image_too_large"),
        (data_url(image_bytes("PNG", (64, 64))[:40]), 400, "invalid_image"),
        (data_url(b"\x89PNG garbage"), 400, "invalid_image"),
        (data_url(bytes(range(256)) * 300), 413, "image_too_large"),  # 76,800 bytes
        ("https://example.com/a.png", 400, "image_url_refused"),
    ]:
        err = ask(url)
        assert err.status_code == status and err.body["code"] == code, (url[:40], err.body)
    _serves_on(front)


def test_capabilities_in_models_status_and_describe(front: Front) -> None:
    from contract.types import OpenSessionRequest
    from harness.fixtures import tool_gguf

    cards = front.sdk().models.list().data
    assert cards[0].model_extra is not None and cards[0].model_extra["capabilities"] == ["text"]
    with front.daemon.client() as c:
        st = c.status()
        assert st.active is not None and st.active.capabilities == ["text"]
        info = c.describe(OpenSessionRequest(path=str(tool_gguf()), type=st.active.type))
    assert info.capabilities == ["text", "tools", "reasoning"]


def test_a_websocket_generation_with_an_image_gets_the_error_and_the_connection_serves_on(front: Front) -> None:
    pytest.importorskip("websockets")
    from runtime.ws import WsClient, WsError

    with WsClient(f"ws://127.0.0.1:{front.port}/v1/ws", timeout_s=300.0) as c:
        with pytest.raises(WsError) as err:
            c.generate(messages=[{"role": "user", "content": [
                {"type": "text", "text": USER}, {"type": "image_url", "image_url": {"url": data_url(PNG)}}]}],
                max_tokens=2)
        assert (err.value.code, err.value.recoverable, err.value.recovery_action) == (
            "vision_unsupported", False, "load_model")
        done = c.generate(messages=[{"role": "user", "content": "Say hi."}], max_tokens=2, temperature=0)
        assert done["finish_reason"] in ("length", "stop")
