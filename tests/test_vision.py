"""Vision: the test model (``harness.vision``) and llama.cpp's multimodal library in the build ``make`` installs.

The projector is built from a random Gemma 3-shaped vision stage and paired with the bundled SmolLM2; these tests
check what every later vision test stands on: the library is there, it loads the projector against the bundled
model, and an image becomes ``IMAGE_TOKENS`` embeddings that follow the image (the same image twice the same,
two different images apart).
"""

from __future__ import annotations

import contextlib
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


# --- through a daemon: the three APIs, reuse, capabilities, the client's seam ---------------------------------
USER = "What is in this picture?"


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("fastapi")
    from harness.vision import vision_projector
    from tests.test_openai_front import Front

    with Front(tmp_path_factory.mktemp("vision"), "--num-ctx", "2048", "--mmproj", str(vision_projector()),
               backend="llama") as f:
        yield f


def _url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def _chat(front: Any, image: bytes, *, stream: bool = False, max_tokens: int = 8) -> tuple[str, int]:
    """The greedy reply to USER and ``image`` through chat completions, and the prompt's tokens."""
    content = [{"type": "text", "text": USER}, {"type": "image_url", "image_url": {"url": _url(image)}}]
    kw: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "temperature": 0,
                          "messages": [{"role": "user", "content": content}]}
    if not stream:
        out = front.sdk().chat.completions.create(**kw)
        return out.choices[0].message.content, out.usage.prompt_tokens
    text, usage = "", None
    for chunk in front.sdk().chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert usage is not None
    return text, usage.prompt_tokens


def _responses(front: Any, image: bytes, *, stream: bool = False) -> tuple[str, int]:
    content = [{"type": "input_text", "text": USER}, {"type": "input_image", "image_url": _url(image)}]
    kw: dict[str, Any] = {"model": "m", "max_output_tokens": 8, "temperature": 0,
                          "input": [{"role": "user", "content": content}]}
    if not stream:
        out = front.sdk().responses.create(**kw)
        return out.output_text, out.usage.input_tokens
    text, done = "", None
    for event in front.sdk().responses.create(**kw, stream=True):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert done is not None and done.output_text == text
    return text, done.usage.input_tokens


def _messages(front: Any, image: bytes, *, stream: bool = False) -> tuple[str, int]:
    import base64

    import anthropic

    content = [{"type": "text", "text": USER},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(image).decode()}}]
    kw: dict[str, Any] = {"model": "m", "max_tokens": 8, "extra_body": {"temperature": 0},
                          "messages": [{"role": "user", "content": content}]}
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{front.port}", api_key="none", max_retries=0,
                             timeout=600) as client:
        if stream:
            with client.messages.stream(**kw) as s:
                out = s.get_final_message()
        else:
            out = client.messages.create(**kw)
    u = out.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    return "".join(b.text for b in out.content if b.type == "text"), prompt


def test_an_image_is_the_same_prompt_and_answer_in_every_api_streamed_or_not(front: Any) -> None:
    red = _png((255, 0, 0))
    answers = {(api.__name__, stream): api(front, red, stream=stream)
               for api in (_chat, _responses, _messages) for stream in (False, True)}
    assert len(set(answers.values())) == 1, answers
    text, prompt = answers[("_chat", False)]
    from contract.types import OpenSessionRequest
    from harness.vision import IMAGE_TOKENS

    with front.daemon.client() as c:
        sess = c.open_session(OpenSessionRequest())
        plain = len(sess.tokenize(USER))
        sess.close()
    # the image's block (its markers and IMAGE_TOKENS embeddings) is in the prompt the usage counts
    assert prompt > plain + IMAGE_TOKENS and text


def test_the_image_changes_the_answer_and_the_same_image_gives_the_same(front: Any) -> None:
    red, blue = _png((255, 0, 0)), _png((0, 0, 255))
    first, other, again = (_chat(front, img, max_tokens=12)[0] for img in (red, blue, red))
    assert first == again
    assert first != other


def test_a_second_turn_resending_the_image_reuses_its_block(front: Any) -> None:
    green = _png((0, 160, 0))
    content = [{"type": "text", "text": USER}, {"type": "image_url", "image_url": {"url": _url(green)}}]
    sdk = front.sdk()
    one = sdk.chat.completions.create(model="m", max_tokens=8, temperature=0,
                                      messages=[{"role": "user", "content": content}])
    two = sdk.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": content}, {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "And what colour is it?"}])
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens, (cached, one.usage.prompt_tokens)  # the image's block included
    assert two.usage.prompt_tokens > cached


def test_a_text_prompt_after_an_image_turn_is_its_cold_tokens_and_answer(front: Any) -> None:
    """Warm equals cold around an image block: a text-only prompt that is the head of the image turn sent just
    before it (the text parts from the held prompt where the image's marker began) is tokenized as it is on its
    own, and answers the same: the tokens held up to the image's marker are not kept where the new prompt's
    text spells them otherwise."""
    sdk = front.sdk()
    text = [{"role": "user", "content": USER}]
    alone = sdk.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=text)
    image = [{"role": "user", "content": [{"type": "text", "text": USER},
                                          {"type": "image_url", "image_url": {"url": _url(_png((200, 0, 200)))}}]}]
    sdk.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=image)
    again = sdk.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=text)
    assert again.usage.prompt_tokens == alone.usage.prompt_tokens
    assert again.choices[0].message.content == alone.choices[0].message.content


def test_another_image_is_the_reason_given_for_the_miss(front: Any) -> None:
    """The same words with another image: the prompt parts at the image's block, and the miss says so (its
    placeholders have no text; the excerpts show ``[image]``)."""
    sdk = front.sdk()

    def usage(image: bytes) -> dict[str, Any]:
        content = [{"type": "text", "text": "Which picture is this?"}, {"type": "image_url", "image_url": {"url": _url(image)}}]
        out = sdk.chat.completions.create(model="m", max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": content}])
        assert out.usage is not None and out.usage.model_extra is not None
        return out.usage.model_extra

    usage(_png((200, 10, 10)))
    miss = usage(_png((10, 10, 200)))["cache_miss"]
    assert miss["cause"] == "first_sight" and miss["message"] == 0, miss
    assert "another image" in miss["detail"], miss
    assert miss["new_text"].startswith("[image]") and miss["held_text"].startswith("[image]"), miss


def test_capabilities_of_a_vision_model_in_models_and_status(front: Any) -> None:
    cards = front.sdk().models.list().data
    assert cards[0].model_extra is not None and cards[0].model_extra["capabilities"] == ["text", "vision"]
    with front.daemon.client() as c:
        st = c.status()
    assert st.active is not None and st.active.capabilities == ["text", "vision"]


def test_bad_images_and_misplaced_ones_are_refused_and_the_daemon_serves_on(front: Any) -> None:
    import openai

    from tests.test_images import png_claiming

    for content, code in [
        ([{"type": "image_url", "image_url": {"url": _url(png_claiming(50_000, 50_000))}}], "image_too_large"),
        ([{"type": "image_url", "image_url": {"url": _url(_png((1, 2, 3))[:60])}}], "invalid_image"),
    ]:
        with pytest.raises((openai.BadRequestError, openai.APIStatusError)) as err:
            front.sdk().chat.completions.create(model="m", max_tokens=4,
                                                messages=[{"role": "user", "content": content}])
        assert err.value.body["code"] == code, err.value.body
    with pytest.raises(openai.BadRequestError) as err:  # a system prompt carries no image
        front.sdk().chat.completions.create(model="m", max_tokens=4, messages=[
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": _url(_png((9, 9, 9)))}}]},
            {"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "invalid_image" and "system" in err.value.body["message"]
    assert _chat(front, _png((255, 0, 0)))[0]


def test_an_image_over_the_websocket_is_the_prompt_and_answer_of_chat_completions(front: Any) -> None:
    """The WebSocket protocol takes chat completions' content parts: the same image gives the same prompt tokens and
    the same greedy text; a broken one is an error message and the connection serves on."""
    pytest.importorskip("websockets")
    from runtime.ws import WsClient, WsError

    red = _png((255, 0, 0))
    text, prompt = _chat(front, red)
    content = [{"type": "text", "text": USER}, {"type": "image_url", "image_url": {"url": _url(red)}}]
    with WsClient(f"ws://127.0.0.1:{front.port}/v1/ws", timeout_s=300.0) as c:
        done = c.generate(messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
        assert (done["generated_text"], done["usage"]["prompt_tokens"]) == (text, prompt)
        broken = [{"type": "text", "text": USER}, {"type": "image_url", "image_url": {"url": _url(red[:60])}}]
        with pytest.raises(WsError) as err:
            c.generate(messages=[{"role": "user", "content": broken}], max_tokens=8, temperature=0)
        assert err.value.code == "invalid_image", err.value.body
        again = c.generate(messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
        assert again["generated_text"] == text


def test_the_client_appends_an_image_and_a_fork_or_cut_inside_its_block_is_refused(front: Any) -> None:
    from contract.errors import InvalidArgument
    from contract.types import OpenSessionRequest, PrefixInput, SuffixInput
    from harness.vision import IMAGE_TOKENS
    from tests.test_openai_front import slot_free

    slot_free(front)  # the turn a test before ran is closed after its reply was sent
    with front.daemon.client() as c:
        sess = c.open_session(OpenSessionRequest())
        m = sess.manifest()
        start = sess.ensure_prefix(PrefixInput(text="You describe images.", manifest=m)).resident_tokens
        st = sess.append_image(_png((255, 0, 0)), start, text="Look: ", manifest=m)
        assert st.image_tokens == IMAGE_TOKENS
        end = st.resident_tokens
        assert end >= start + len(sess.tokenize("Look: ")) + IMAGE_TOKENS
        # the block's embedding positions are the last IMAGE_TOKENS before its closing text: a cut among them
        inside = end - 1
        while inside > start:
            with contextlib.suppress(InvalidArgument):
                sess.fork(inside).close()
                inside -= 1
                continue
            break
        with pytest.raises(InvalidArgument, match="inside an image"):
            sess.fork(inside)
        with pytest.raises(InvalidArgument, match="inside an image"):
            sess.prefill_suffix(SuffixInput(text="x", render=False, offset=inside, truncating=True, manifest=m))
        fork = sess.fork(end)  # after the block: a fork as any other
        fork.close()
        again = sess.prefill_suffix(SuffixInput(text=" ok", render=False, offset=end, manifest=m))
        assert again.resident_tokens == end + len(sess.tokenize(" ok"))
        sess.close()


def test_a_projector_beside_the_model_is_found_and_none_turns_it_off(tmp_path: Any) -> None:
    """As ``modeld pull`` lays a vision model out (``test_store``): the projector in the model's folder is its image
    encoder, said by ``describe`` before any load; ``mmproj=none`` serves the model as text only, and auto then
    leaves OpenVINO (which serves no image encoder) out."""
    from backends.bundled import bundled_gguf_path
    from backends.llama.backend import LlamaBackend
    from backends.registry import ENGINES
    from contract.types import Config, OpenSessionRequest
    from harness.vision import vision_projector

    (tmp_path / "see.gguf").symlink_to(bundled_gguf_path())
    (tmp_path / "mmproj-see-f16.gguf").symlink_to(vision_projector())
    req = OpenSessionRequest(path=str(tmp_path / "see.gguf"))
    backend = LlamaBackend()
    assert backend.describe(req).capabilities == ["text", "vision"]
    off = req.model_copy(update={"config": Config(options={"mmproj": "none"})})
    assert backend.describe(off).capabilities == ["text"]
    refusal = ENGINES["openvino"].refusal
    if refusal is not None and "openvino" in ENGINES:
        assert "image encoder" in refusal(tmp_path / "see.gguf")


def test_a_miss_at_an_image_block_in_a_later_message_is_history_rewritten_and_names_the_image() -> None:
    from backends.image_tokens import placeholders
    from backends.tape.miss import Held, suffix_miss

    red, blue = placeholders("a" * 64, 4), placeholders("b" * 64, 4)
    held = Held(tokens=[1, 2, 3, 10, *red, 11, 12], manifest=None, messages=["m0", "m1"])
    target = [1, 2, 3, 10, *blue, 11, 12, 13]
    miss = suffix_miss(held, target, ["m0", "m1*"], prefix_len=3, reused=4, seen=0, restored=None,
                       token_bytes=lambda ts: [f"<{t}>".encode() for t in ts])
    assert miss is not None and miss.cause.value == "history_rewritten" and miss.message == 1 and miss.index == 4
    assert "another image" in miss.detail
    assert (miss.held_text, miss.new_text) == ("[image]<11><12>", "[image]<11><12><13>")
