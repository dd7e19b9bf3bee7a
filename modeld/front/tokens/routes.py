"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` on a session of the loaded model, and
``GET /v1/readouts``: the readout manifest the daemon serves."""

from __future__ import annotations

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from contract.types import ReadoutInfo

from ..core import Serving, declared, dumped
from ..errors import ApiError
from ..openai.protocol import ErrorBody
from .protocol import DetokenizeIn, DetokenizeOut, TokenizeIn, TokenizeOut, TokenizerInfo


def router(serving: Serving) -> APIRouter:
    r = APIRouter()

    @r.post("/tokenize", response_model=None, responses=declared(TokenizeOut, ErrorBody))
    async def tokenize(body: TokenizeIn) -> JSONResponse:
        if body.with_pieces:
            raise ApiError(400, "with_pieces is not served here: /detokenize a token for its text",
                           code="unsupported", param="with_pieces")
        if not body.parse_special:
            raise ApiError(400, "parse_special false is not served here: special tokens are parsed, as in a prompt",
                           code="unsupported", param="parse_special")
        tokens = await serving.aon_session(body.model, lambda s: s.tokenize(body.text, add_special=body.special))
        return JSONResponse(dumped(TokenizeOut(tokens=tokens, count=len(tokens))))

    @r.post("/detokenize", response_model=None, responses=declared(DetokenizeOut, ErrorBody))
    async def detokenize(body: DetokenizeIn) -> JSONResponse:
        text = await serving.aon_session(body.model, lambda s: s.detokenize(body.tokens))
        return JSONResponse(dumped(DetokenizeOut(content=text, prompt=text)))

    @r.get("/tokenizer_info", response_model=None, responses=declared(TokenizerInfo, ErrorBody))
    async def tokenizer_info() -> JSONResponse:
        active = await anyio.to_thread.run_sync(serving.active)  # (the status: no turn waited for)
        return JSONResponse(dumped(TokenizerInfo(model_max_length=active.effective_context, eos_token=None,
                                                 bos_token=None, pad_token=None)))

    @r.get("/v1/readouts", response_model=None, responses=declared(ReadoutInfo, ErrorBody))
    async def readouts() -> JSONResponse:
        info = await anyio.to_thread.run_sync(serving.readouts)
        return JSONResponse(info.model_dump(mode="json"))

    return r
