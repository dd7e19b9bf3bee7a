"""The codec (contract/wire.py, contract/messages.py): schemas per operation, payload frames, typed failures."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import msgpack
import pytest
from pydantic import BaseModel

from contract import wire
from contract.errors import (
    BadFrame,
    FrameTooLarge,
    InvalidArgument,
    ModeldError,
    SessionClosed,
    UnknownOperation,
    UnsupportedProtocolVersion,
)
from contract.manifest import ContextManifest
from contract.messages import (
    BytesFrame,
    CacheClearReply,
    CacheClearRequest,
    CacheListReply,
    CacheListRequest,
    CancelReply,
    CancelRequest,
    CancelTurnReply,
    CancelTurnRequest,
    CloseReply,
    CountTokensRequest,
    DecodeRequest,
    DetokenizeReply,
    DetokenizeRequest,
    EmbedReply,
    EnsurePrefixRequest,
    F32MatrixFrame,
    ForkRequest,
    HeartbeatReply,
    HeartbeatRequest,
    MetricsReply,
    MetricsRequest,
    OpenReply,
    PrefillSuffixRequest,
    ReadReply,
    ReadRequest,
    RestoreRequest,
    SessionRef,
    SnapshotReply,
    SnapshotRequest,
    StatusRequest,
    TakeoverReply,
    TakeoverRequest,
    TokenizeReply,
    TokenizeRequest,
    UnloadReply,
    WhyReply,
    WhyRequest,
    payload_frame,
)
from contract.types import (
    ActiveModel,
    BlobStatus,
    CacheEntryInfo,
    CacheStatus,
    ChatMessage,
    Config,
    ContextReport,
    DaemonStatus,
    DecodeConfig,
    EmbeddingStatus,
    EmbedRequest,
    EmbedResult,
    LoadModelRequest,
    MissCause,
    ModelInfo,
    ModelsStatus,
    OpenSessionRequest,
    PrefixInput,
    PrefixStatus,
    ReuseMiss,
    ReuseRecord,
    SessionSnapshot,
    SlotState,
    StreamChunk,
    StructuredOutputConfig,
    SuffixInput,
    SuffixStatus,
    TokenCount,
    ToolCall,
    ToolCallFunction,
    UnloadModelRequest,
    Usage,
)
from contract.wire import Kind, Message, Op

MANIFEST = ContextManifest(profile="p", backend="memory", model_digest="sha256:" + "a" * 64, bos_policy="add")
ACTIVE = ActiveModel(model_name="m", type="memory", path="/models/m", config=Config(num_ctx=2048), generation=3,
                     effective_context=2048, resident_bytes=1 << 20)
STATE = bytes(range(256)) * 3  # not UTF-8: must travel untouched
SNAP = SessionSnapshot(
    state=STATE, state_id="sha256:" + hashlib.sha256(STATE).hexdigest(), state_kind="kv",
    state_digest="sha256:" + "b" * 64, backend="memory", resident_tokens=5, prefix_tokens=3, num_ctx=2048,
    resident_token_ids=[1, 2, 3, 4, 5], stable_text="sys", prefix_text="sys", tools="", manifest=MANIFEST,
)
HANDLE = {"owner_instance_id": "o", "model_name": "m", "type": "memory", "path": "/models/m"}

#: the status maps as a daemon fills them
EMBEDDING = EmbeddingStatus(backend="llama", loaded=False, model_name="", path="", digest="", dims=0, window=0, pooling="",
                            resident_bytes=0, last_used=None, idle_s=None, idle_unload_s=300.0, loads=0,
                            embedded_inputs=0, last_error="")
CACHE = CacheStatus(ram_entries=1, ram_bytes=10, ram_budget_bytes=100, disk_entries=0, disk_bytes=0,
                    disk_budget_bytes=0, disk_dir="", disk_written_bytes=0, hits=3, misses=1, hit_rate=0.75,
                    restored_tokens=2048, saves=4, evictions=0, rejected=0, last_rejection="")

#: one request and one reply of every operation, with as many fields set as is useful
SAMPLES: dict[Op, tuple[BaseModel, BaseModel]] = {
    Op.STATUS: (
        StatusRequest(),
        DaemonStatus(owner_instance_id="o", backend="memory", protocol_version=1, state=SlotState.BUSY, active=ACTIVE,
                     generation=3, busy_operation="decode", load_progress=0.5, session_open=True, pid=42,
                     embedding=EMBEDDING, cache=CACHE,
                     blobs=BlobStatus(blobs=1, bytes=2, max_bytes=3, max_age_s=4.0, pruned=0),
                     models=ModelsStatus(dir="/m", models=1, bytes=5, names=["a"], aliases={"b": "a"})),
    ),
    Op.LOAD: (LoadModelRequest(**HANDLE, config=Config(num_ctx=2048, tensor_split=[0.5, 0.5]), expected_generation=2), ACTIVE),
    Op.UNLOAD: (UnloadModelRequest(owner_instance_id="o", expected_generation=3), UnloadReply(generation=4)),
    Op.DESCRIBE: (
        OpenSessionRequest(**HANDLE),
        ModelInfo(model_max_context=8192, effective_context=2048, kv_bytes_per_token=24576, clamped=True, reason="memory"),
    ),
    Op.EMBED: (
        EmbedRequest(**HANDLE, texts=["a", "bb"], truncate=True),
        EmbedReply(vectors=[[0.5, -1.25, 3.0], [0.0, 1.0, -0.125]], dims=3, count=2, model_name="e",
                   digest="sha256:" + "c" * 64, tokens=[3, 4], truncated=[1]),
    ),
    Op.OPEN: (OpenSessionRequest(**HANDLE), OpenReply(session_id="s1", generation=3, num_ctx=2048,
                                                      manifest=MANIFEST.identity(), active=ACTIVE)),
    Op.ENSURE_PREFIX: (
        EnsurePrefixRequest.of("s1", PrefixInput(text="system prompt", manifest=MANIFEST, tools='[{"name": "f"}]')),
        PrefixStatus(reused_tokens=2, prefilled_tokens=1, prefix_tokens=3, resident_tokens=3, prefill_ms=1.5),
    ),
    Op.PREFILL_SUFFIX: (
        PrefillSuffixRequest.of("s1", SuffixInput(manifest=MANIFEST, messages=[
            ChatMessage(role="user", content="hi"),
            ChatMessage(role="assistant", tool_calls=[ToolCall(id="c1", function=ToolCallFunction(name="f", arguments="{}"))]),
            ChatMessage(role="tool", tool_call_id="c1", name="f", content="42"),
        ])),
        SuffixStatus(suffix_tokens=9, prefix_tokens=3, resident_tokens=12, reused_tokens=4, prefilled_tokens=5),
    ),
    Op.DECODE: (
        DecodeRequest.of("s1", DecodeConfig(max_tokens=8, temperature=0.0, seed=7, stop=["\n"],
                                            structured_output=StructuredOutputConfig(regex="[a-z]+"))),
        StreamChunk(done=True, finish_reason="length", usage=Usage(prompt_tokens=12, completion_tokens=8, ttft_ms=3.0)),
    ),
    Op.CANCEL: (CancelRequest(request_id=b"\xff\x00rid"), CancelReply(cancelled=True)),
    Op.EXPLAIN: (SessionRef(session_id="s1"), ContextReport(resident_tokens=5, num_ctx=2048, manifest=MANIFEST)),
    Op.SNAPSHOT: (
        SnapshotRequest(session_id="s1", include_state=True),
        SnapshotReply.of(SNAP, state_id=SNAP.state_id, include_state=True),
    ),
    Op.RESTORE: (RestoreRequest.of("s1", SNAP), ContextReport(resident_tokens=5, prefix_tokens=3, num_ctx=2048)),
    Op.CLOSE: (SessionRef(session_id="s1"), CloseReply(closed=True)),
    Op.HEARTBEAT: (HeartbeatRequest(session_ids=["s1", "s2"]), HeartbeatReply(alive=["s1"])),
    Op.CACHE_LIST: (
        CacheListRequest(),
        CacheListReply(entries=[CacheEntryInfo(id="ab12", backend="llama", tokens=2048, prefix_tokens=1990,
                                               bytes=47_000_000, where="ram+disk", last_used=1.5)],
                       cache=CACHE),
    ),
    Op.CACHE_CLEAR: (CacheClearRequest(owner_instance_id="o"), CacheClearReply(cleared=2)),
    Op.TAKEOVER: (TakeoverRequest(owner_instance_id="o2", epoch=3), TakeoverReply(owner="fp:0123", epoch=3, ended_session=True)),
    Op.METRICS: (MetricsRequest(), MetricsReply(text="# TYPE modeld_requests_total counter\nmodeld_requests_total 1.0\n")),
    Op.WHY: (
        WhyRequest(last=2),
        WhyReply(requests=[
            ReuseRecord(at=1.5, prompt_tokens=900, prefilled_tokens=900,
                        miss=ReuseMiss(cause=MissCause.FIRST_SIGHT, new_text="<|im_start|>system")),
            ReuseRecord(at=2.5, prompt_tokens=920, reused_tokens=460, prefilled_tokens=460,
                        miss=ReuseMiss(cause=MissCause.SYSTEM_CHANGED, index=460, held_tokens=950, held_text=" 20:",
                                       new_text=" twenty:", detail="the system prompt differs from character 1618")),
        ]),
    ),
    Op.COUNT_TOKENS: (
        CountTokensRequest(session_id="s1", prefix=PrefixInput(text="sys", tools='[{"type": "function"}]'),
                           suffix=SuffixInput(messages=[ChatMessage(role="user", content="hi")])),
        TokenCount(prompt_tokens=120, prefix_tokens=100, num_ctx=8192, resident_tokens=100),
    ),
    Op.TOKENIZE: (TokenizeRequest(session_id="s1", text="<|im_start|>user\nhi", add_special=True),
                  TokenizeReply(tokens=[1, 9, 4093, 198, 6004])),
    Op.DETOKENIZE: (DetokenizeRequest(session_id="s1", tokens=[1, 9, 4093]), DetokenizeReply(text="<|im_start|>user")),
    Op.FORK: (ForkRequest(session_id="s1", at_position=1500), OpenReply(session_id="s2", generation=3, num_ctx=4096)),
    Op.READ: (ReadRequest(request_id=b"\xff\x00rid", frames=12), ReadReply()),
    Op.CANCEL_TURN: (CancelTurnRequest(owner_instance_id="o", session_id=""),
                     CancelTurnReply(session_id="s1", client="POST /v1/messages from 127.0.0.1:50123")),
}


def _request_round_trip(op: Op, req: BaseModel) -> BaseModel:
    msg = wire.decode_request(wire.encode_request(op, b"rid", req))
    assert msg.op is op and msg.request_id == b"rid"
    return wire.decode_body(wire.SCHEMAS[op].request, msg)


def _reply_round_trip(kind: Kind, reply: BaseModel, cls: type[BaseModel]) -> BaseModel:
    msg = wire.decode_reply(wire.encode_reply(kind, b"rid", reply))
    assert msg.kind is kind and msg.request_id == b"rid"
    return wire.decode_body(cls, msg)


def _message(body: dict[str, Any], payloads: list[bytes] | None = None) -> Message:
    return Message(request_id=b"r", body=body, payloads=payloads or [])


# --- the tables ------------------------------------------------------------------------------------------
def test_op_and_kind_frames_are_pinned() -> None:
    assert {op.value for op in Op} == {
        "status", "load", "unload", "describe", "embed", "open", "ensure_prefix", "prefill_suffix", "decode",
        "cancel", "explain", "snapshot", "restore", "close", "heartbeat", "cache_list", "cache_clear", "metrics", "takeover",
            "count_tokens", "why", "tokenize", "detokenize", "fork", "read", "cancel_turn",
    }
    assert {k.name: k.value for k in Kind} == {"OK": "ok", "DATA": "data", "END": "end", "ERROR": "error", "HEARTBEAT": "hb"}
    assert {k for k in Kind if k.terminal} == {Kind.OK, Kind.END, Kind.ERROR}


def test_every_operation_has_a_schema_and_a_sample() -> None:
    assert set(wire.SCHEMAS) == set(Op) == set(SAMPLES)
    assert [op for op, s in wire.SCHEMAS.items() if s.stream] == [Op.DECODE]
    for op, (req, reply) in SAMPLES.items():
        assert type(req) is wire.SCHEMAS[op].request, op
        assert type(reply) is wire.SCHEMAS[op].reply, op


def test_payload_frames_are_declared_where_bytes_travel() -> None:
    declared = {cls: payload_frame(cls) for s in wire.SCHEMAS.values() for cls in (s.request, s.reply)}
    assert {cls for cls, spec in declared.items() if spec is not None} == {EmbedReply, SnapshotReply, RestoreRequest}
    assert payload_frame(EmbedReply) == F32MatrixFrame("vectors", rows_field="count", cols_field="dims")
    assert payload_frame(SnapshotReply) == BytesFrame("state", size_field="state_bytes", optional=True)


# --- every schema round trips through frames ---------------------------------------------------------------
@pytest.mark.parametrize("op", list(Op))
def test_request_round_trip(op: Op) -> None:
    req = SAMPLES[op][0]
    assert _request_round_trip(op, req) == req


@pytest.mark.parametrize("op", list(Op))
def test_reply_round_trip(op: Op) -> None:
    reply = SAMPLES[op][1]
    kind = Kind.END if wire.SCHEMAS[op].stream else Kind.OK
    assert _reply_round_trip(kind, reply, wire.SCHEMAS[op].reply) == reply


def test_session_scoped_requests_are_flat_and_give_back_the_contract_type() -> None:
    for op, inner in ((Op.ENSURE_PREFIX, PrefixInput), (Op.PREFILL_SUFFIX, SuffixInput), (Op.DECODE, DecodeConfig)):
        req = SAMPLES[op][0]
        body, payloads = wire.encode_body(req)
        assert payloads == [] and body["session_id"] == "s1"
        # the input's own names, one map (a decode adds whether its client reports its reads)
        assert set(body) - {"reads"} == {"session_id", *inner.model_fields}
        back = _request_round_trip(op, req)
        got = back.input  # type: ignore[attr-defined]
        assert type(got) is inner and got == inner.model_validate({k: v for k, v in body.items()
                                                                   if k not in ("session_id", "reads")})


def test_session_id_is_validated_like_any_field() -> None:
    for body in ({"text": "x"}, {"session_id": "", "text": "x"}, {"session_id": 7, "text": "x"}):
        with pytest.raises(InvalidArgument) as exc:
            wire.decode_body(EnsurePrefixRequest, _message(body))
        assert exc.value.details["problems"][0].startswith("session_id:")
    with pytest.raises(InvalidArgument, match="bogus"):
        wire.decode_body(DecodeRequest, _message({"session_id": "s", "bogus": 1}))
    with pytest.raises(InvalidArgument, match="max_tokens"):
        wire.decode_body(DecodeRequest, _message({"session_id": "s", "max_tokens": -5}))


@pytest.mark.parametrize(
    ("cls", "body", "field"),
    [
        (CancelRequest, {"request_id": "text, not bytes"}, "request_id"),
        (HeartbeatRequest, {"session_ids": ["s", b"bytes"]}, "session_ids.1"),
        (SnapshotRequest, {"session_id": "s", "include_state": "yes"}, "include_state"),
        (RestoreRequest, {"session_id": "s", "snapshot": [1, 2]}, "snapshot"),
        (RestoreRequest, {"session_id": "s"}, "snapshot"),
        (SessionRef, {"session_id": "s", "extra": 1}, "extra"),
        (StatusRequest, {"verbose": True}, "verbose"),
    ],
)
def test_bad_fields_are_invalid_arguments_naming_them(cls: type[BaseModel], body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        wire.decode_body(cls, _message(body))
    assert any(p.startswith(f"{field}:") for p in exc.value.details["problems"]), exc.value.details


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"text": "a", "tokens": [1]}, "one of them"),
        ({"tokens": [1], "truncating": True}, "give the offset"),
        ({"text": "a", "offset": 3}, "raw"),  # a rendered turn has no place at an offset
        ({"messages": [{"role": "user", "content": "a"}], "offset": 3}, "raw"),
        ({"tokens": [1], "offset": -1}, "offset"),
    ],
)
def test_a_suffix_takes_one_form_and_an_offset_only_raw(body: dict[str, Any], said: str) -> None:
    with pytest.raises((InvalidArgument, ValueError), match=said):
        SuffixInput(**body)


def test_a_raw_prefix_has_no_tools() -> None:
    assert PrefixInput(text="def f(", render=False).render is False
    with pytest.raises(InvalidArgument, match="raw prefix"):
        PrefixInput(text="x", tools='[{"type": "function"}]', render=False)


# --- the bodies hand-made frames rely on -----------------------------------------------------------------------
def test_body_field_names() -> None:
    embed, frames = wire.encode_body(SAMPLES[Op.EMBED][1])
    assert set(embed) == {"dims", "count", "model_name", "digest", "tokens", "truncated"} and len(frames) == 1
    snap, frames = wire.encode_body(SAMPLES[Op.SNAPSHOT][1])
    assert set(snap) == set(SessionSnapshot.model_fields) - {"state"} | {"state_bytes"} and frames == [STATE]
    assert snap["state_bytes"] == len(STATE) and snap["state_id"] == SNAP.state_id
    restore, frames = wire.encode_body(SAMPLES[Op.RESTORE][0])
    assert set(restore) == {"session_id", "snapshot"} and "state" not in restore["snapshot"] and frames == [STATE]
    assert set(wire.encode_body(SAMPLES[Op.OPEN][1])[0]) == {
        "session_id", "generation", "num_ctx", "manifest", "active", "lease_s", "sampling"}
    assert set(wire.encode_body(SAMPLES[Op.COUNT_TOKENS][0])[0]) == {"session_id", "prefix", "suffix"}
    assert wire.encode_body(SnapshotRequest(session_id="s"))[0] == {"session_id": "s", "include_state": False}
    assert wire.encode_body(CancelRequest(request_id=b"\xff"))[0] == {"request_id": b"\xff"}  # msgpack bin, not text
    assert wire.encode_body(HeartbeatRequest(session_ids=["a"]))[0] == {"session_ids": ["a"]}
    assert wire.encode_body(CloseReply(closed=True))[0] == {"closed": True}
    assert wire.encode_body(UnloadReply(generation=2))[0] == {"generation": 2}


def test_stream_elements() -> None:
    chunk = StreamChunk(text="hi", token_ids=[5])
    data = wire.decode_reply(wire.encode_chunk(b"r", chunk))
    assert data.kind is Kind.DATA and "usage" not in data.body  # usage comes with the final chunk only
    assert wire.decode_body(StreamChunk, data) == chunk
    final = SAMPLES[Op.DECODE][1]
    end = wire.decode_reply(wire.encode_chunk(b"r", final))  # type: ignore[arg-type]
    assert end.kind is Kind.END and wire.decode_body(StreamChunk, end) == final


def test_snapshot_reply_without_state() -> None:
    reply = SnapshotReply.of(SNAP, state_id=SNAP.state_id, include_state=False)
    frames = wire.encode_reply(Kind.OK, b"r", reply)
    assert len(frames) == 4  # no payload frame: the daemon keeps the bytes under state_id
    back = wire.decode_body(SnapshotReply, wire.decode_reply(frames))
    assert back.state == b"" and back.state_bytes == len(STATE)
    snap = back.snapshot()
    assert type(snap) is SessionSnapshot and snap == SNAP.model_copy(update={"state": b""})
    assert SAMPLES[Op.SNAPSHOT][1].snapshot() == SNAP  # type: ignore[attr-defined]


def test_restore_request_state_from_frame_or_state_id() -> None:
    by_id = RestoreRequest.of("s", SNAP.model_copy(update={"state": b""}))
    assert wire.encode_body(by_id)[1] == []
    assert _request_round_trip(Op.RESTORE, by_id) == by_id and by_id.state is None
    # an empty frame is a frame: the daemon restores those (empty) bytes, not the blob
    empty = wire.decode_body(RestoreRequest, _message(wire.to_body(by_id, exclude={"state"}), [b""]))
    assert empty.state == b""
    # state bytes inside the snapshot map are never read
    body = wire.to_body(by_id, exclude={"state"})
    body["snapshot"]["state"] = b"ignored"
    assert wire.decode_body(RestoreRequest, _message(body)).snapshot.state == b""


def test_embed_reply_to_result() -> None:
    reply = SAMPLES[Op.EMBED][1]
    assert isinstance(reply, EmbedReply)
    many = reply.result(single=False)
    assert type(many) is EmbedResult and many.vector == [] and many.vectors == reply.vectors and many.dims == 3
    one = EmbedReply.of(EmbedResult(vector=[1.0, 2.0], model_name="e"))
    assert (one.count, one.dims, one.vectors) == (1, 2, [[1.0, 2.0]])
    assert one.result(single=True).vector == [1.0, 2.0]
    none = EmbedReply.of(EmbedResult())
    assert (none.count, none.dims) == (0, 0)
    assert _reply_round_trip(Kind.OK, none, EmbedReply) == none


# --- payload helpers --------------------------------------------------------------------------------------------------
def test_f32_matrix_is_little_endian_row_after_row() -> None:
    rows = [[1.0, -2.0], [0.5, 3.25], [0.0, -0.0]]
    data = wire.encode_f32_matrix(rows)
    assert data[:4] == b"\x00\x00\x80\x3f" and data == struct.pack("<6f", 1.0, -2.0, 0.5, 3.25, 0.0, -0.0)
    assert wire.decode_f32_matrix(data, dims=2, count=3) == rows
    assert wire.decode_f32_matrix(data, dims=3, count=2) == [[1.0, -2.0, 0.5], [3.25, 0.0, -0.0]]
    assert wire.encode_f32_matrix([]) == b"" and wire.decode_f32_matrix(b"", dims=0, count=0) == []
    assert wire.decode_f32_matrix(b"", dims=0, count=2) == [[], []]
    assert wire.decode_f32_matrix(wire.encode_f32_matrix([[0.1]]), dims=1, count=1)[0][0] == pytest.approx(0.1)


@pytest.mark.parametrize(("size", "dims", "count"), [(11, 3, 1), (16, 3, 1), (12, 3, 2), (4, -1, -4), (0, 1, 1)])
def test_f32_matrix_of_the_wrong_size_is_a_bad_frame(size: int, dims: int, count: int) -> None:
    with pytest.raises(BadFrame):
        wire.decode_f32_matrix(b"\x00" * size, dims=dims, count=count)


def test_f32_matrix_needs_rows_of_one_length() -> None:
    with pytest.raises(ValueError, match="one length"):
        wire.encode_f32_matrix([[1.0, 2.0], [3.0]])


def test_bytes_frame() -> None:
    assert wire.encode_bytes_frame(STATE) is STATE  # no copy
    assert wire.decode_bytes_frame(STATE) == STATE
    assert wire.decode_bytes_frame(STATE, size=len(STATE)) == STATE
    with pytest.raises(BadFrame):
        wire.decode_bytes_frame(STATE, size=len(STATE) - 1)


def test_oversize_payloads_are_refused_before_sending(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_PAYLOAD_BYTES", 8)
    with pytest.raises(FrameTooLarge):
        wire.encode_bytes_frame(b"x" * 9)
    with pytest.raises(FrameTooLarge):
        wire.encode_f32_matrix([[1.0, 2.0, 3.0]])
    assert wire.encode_f32_matrix([[1.0, 2.0]]) == struct.pack("<2f", 1.0, 2.0)


def test_encoding_refuses_a_header_that_does_not_match_its_frame() -> None:
    with pytest.raises(ValueError, match="does not match"):
        wire.encode_body(EmbedReply(vectors=[[1.0, 2.0]], dims=3, count=1))
    reply = SnapshotReply.of(SNAP, state_id=SNAP.state_id, include_state=True).model_copy(update={"state_bytes": 1})
    with pytest.raises(ValueError, match="does not match"):
        wire.encode_body(reply)


# --- payload frames that do not fit the schema ------------------------------------------------------------------
def _embed_body(**over: Any) -> dict[str, Any]:
    return {**wire.encode_body(SAMPLES[Op.EMBED][1])[0], **over}


@pytest.mark.parametrize(
    ("cls", "body", "payloads", "match"),
    [
        (EmbedReply, _embed_body(), [], "needs its vectors payload frame"),
        (EmbedReply, _embed_body(), [b"\x00" * 20], "does not hold 2x3"),
        (EmbedReply, _embed_body(count=3), [b"\x00" * 24], "does not hold 3x3"),
        (EmbedReply, _embed_body(vectors=[[1.0]]), [b"\x00" * 24], "not in the body"),
        (EmbedReply, _embed_body(), [b"\x00" * 24, b""], "takes 1 payload frame"),
        (SnapshotReply, wire.encode_body(SAMPLES[Op.SNAPSHOT][1])[0], [STATE[:-1]], "where the body says"),
        (RestoreRequest, {**wire.encode_body(SAMPLES[Op.RESTORE][0])[0], "state": b"x"}, [], "not in the body"),
        (StatusRequest, {}, [b"unexpected"], "takes 0 payload frame"),
        (EnsurePrefixRequest, {"session_id": "s"}, [b"unexpected"], "takes 0 payload frame"),
    ],
)
def test_frames_that_do_not_fit_are_bad_frames(
    cls: type[BaseModel], body: dict[str, Any], payloads: list[bytes], match: str
) -> None:
    with pytest.raises(BadFrame, match=match):
        wire.decode_body(cls, _message(body, payloads))


# --- the envelope ------------------------------------------------------------------------------------------------
def test_raw_maps_still_encode_for_hand_made_requests() -> None:
    frames = wire.encode_request(Op.ENSURE_PREFIX, b"r", {"session_id": "s", "text": "x"}, [b"p"])
    assert frames == [wire.PROTOCOL, b"ensure_prefix", b"r", msgpack.packb({"session_id": "s", "text": "x"}), b"p"]


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([b"MDP9", b"ok", b"r", msgpack.packb({})], UnsupportedProtocolVersion),
        ([wire.PROTOCOL, b"okay", b"r", msgpack.packb({})], BadFrame),
        ([wire.PROTOCOL, b"ok", b"r"], BadFrame),
        ([wire.PROTOCOL, b"ok", b"r", msgpack.packb("not a map")], BadFrame),
        ([wire.PROTOCOL, b"ok", b"r", msgpack.packb({"x": msgpack.ExtType(3, b"")})], BadFrame),
    ],
)
def test_bad_reply_frames_are_typed_errors(frames: list[bytes], error: type[ModeldError]) -> None:
    with pytest.raises(error):
        wire.decode_reply(frames)


@pytest.mark.parametrize("op", list(Op))
def test_each_operation_has_its_own_limits(op: Op) -> None:
    """Checked on the raw frames, before the body is parsed: a status cannot carry a big body or any frame."""
    small = op not in (Op.ENSURE_PREFIX, Op.PREFILL_SUFFIX, Op.DECODE, Op.EMBED, Op.COUNT_TOKENS, Op.TOKENIZE,
                       Op.DETOKENIZE)
    assert wire.body_limit(op) == (wire.MAX_SMALL_BODY_BYTES if small else wire.MAX_BODY_BYTES)
    # a body one byte over the operation's limit (unparsable: it is refused before parsing)
    big = b"\xc1" * (wire.body_limit(op) + 1) if small else None
    if big is not None:
        with pytest.raises(FrameTooLarge) as exc:
            wire.decode_request([wire.PROTOCOL, op.value.encode(), b"r", big])
        assert exc.value.details["op"] == op.value and exc.value.details["limit"] == wire.MAX_SMALL_BODY_BYTES
    takes = wire.payload_frame(wire.SCHEMAS[op].request) is not None
    extra = [b"x"] * (2 if takes else 1)
    with pytest.raises(BadFrame, match=f"{op.value} takes {int(takes)} payload frame"):
        wire.decode_request([wire.PROTOCOL, op.value.encode(), b"r", msgpack.packb({}), *extra])


def test_a_prompt_sized_body_passes_where_prompts_travel() -> None:
    text = "x" * (2 * wire.MAX_SMALL_BODY_BYTES)
    msg = wire.decode_request(wire.encode_request(Op.ENSURE_PREFIX, b"r", {"session_id": "s", "text": text}))
    assert msg.op is Op.ENSURE_PREFIX and len(msg.body["text"]) == len(text)


def test_unknown_operation_names_the_known_ones() -> None:
    with pytest.raises(UnknownOperation) as exc:
        wire.decode_request([wire.PROTOCOL, b"ok", b"r", msgpack.packb({})])
    assert exc.value.details["known"] == sorted(op.value for op in Op)


def test_reply_kind_is_read_without_the_body() -> None:
    assert wire.reply_kind(wire.encode_reply(Kind.HEARTBEAT, b"r")) is Kind.HEARTBEAT
    assert wire.reply_kind([wire.PROTOCOL, b"nope", b"r", b"\xc1"]) is None
    assert wire.reply_kind([wire.PROTOCOL]) is None


def test_error_replies_carry_the_class() -> None:
    frames = wire.encode_error(b"r", SessionClosed("gone", session_id="s1"))
    msg = wire.decode_reply(frames)
    assert msg.kind is Kind.ERROR and wire.reply_kind(frames) is Kind.ERROR
    err = wire.error_of(msg)
    assert type(err) is SessionClosed and err.message == "gone" and err.details == {"session_id": "s1"}


def test_every_operation_has_exactly_one_daemon_handler_taking_its_schema() -> None:
    """A forgotten or misfiled handler shows here, not at run time as ``Internal``: each op is served by the IO
    thread, the worker or the stream table (streams exactly where the schema says), and each handler's request
    parameter is the type the dispatch decodes with."""
    import typing

    from modeld import handlers

    tables: dict[str, dict[Op, Any]] = {"io": dict(handlers.IO_HANDLERS), "worker": dict(handlers.HANDLERS),
                                        "stream": dict(handlers.STREAM_HANDLERS)}
    for op, schema in wire.SCHEMAS.items():
        homes = [name for name, table in tables.items() if op in table]
        assert len(homes) == 1, (op, homes)
        assert (homes[0] == "stream") == schema.stream, op
        hints = typing.get_type_hints(tables[homes[0]][op])
        assert hints["req"] is schema.request, (op, hints["req"], schema.request)
    assert set().union(*tables.values()) == set(wire.SCHEMAS)  # and no handler for an op the wire does not know
