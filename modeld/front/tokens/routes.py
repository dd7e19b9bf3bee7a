"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` on a session of the loaded model, and
``GET /v1/readouts``: the readout manifest the daemon serves."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from contract.types import ReadoutInfo

from ..core import Serving, declared
from ..errors import ApiError
from ..openai.protocol import ErrorBody
from .protocol import DetokenizeIn, DetokenizeOut, TokenizeIn, TokenizeOut, TokenizerInfo


def router(serving: Serving) -> APIRouter:
    r = APIRouter()

    @r.post("/tokenize", response_model=TokenizeOut, response_model_exclude_unset=True,
            responses=declared(TokenizeOut, ErrorBody))
    async def tokenize(body: TokenizeIn) -> TokenizeOut:
        if body.with_pieces:
            raise ApiError(400, "with_pieces is not served here: /detokenize a token for its text",
                           code="unsupported", param="with_pieces")
        if not body.parse_special:
            raise ApiError(400, "parse_special false is not served here: special tokens are parsed, as in a prompt",
                           code="unsupported", param="parse_special")
        tokens = await serving.aon_session(body.model, lambda s: s.tokenize(body.text, add_special=body.special))
        return TokenizeOut(tokens=tokens, count=len(tokens))

    @r.post("/detokenize", response_model=DetokenizeOut, response_model_exclude_unset=True,
            responses=declared(DetokenizeOut, ErrorBody))
    async def detokenize(body: DetokenizeIn) -> DetokenizeOut:
        text = await serving.aon_session(body.model, lambda s: s.detokenize(body.tokens))
        return DetokenizeOut(content=text, prompt=text)

    @r.get("/tokenizer_info", response_model=TokenizerInfo, response_model_exclude_unset=True,
           responses=declared(TokenizerInfo, ErrorBody))
    async def tokenizer_info() -> TokenizerInfo:
        active = await anyio.to_thread.run_sync(serving.active)  # (the status: no turn waited for)
        return TokenizerInfo(model_max_length=active.effective_context, eos_token=None, bos_token=None, pad_token=None)

    @r.get("/v1/readouts", response_model=ReadoutInfo, responses=declared(ReadoutInfo, ErrorBody))
    async def readouts() -> ReadoutInfo:
        return await anyio.to_thread.run_sync(serving.readouts)

    return r
