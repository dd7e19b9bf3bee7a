"""What every contract type shares: the request and report bases, the limits on sizes, token ids."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CAPABILITIES", "TokenId"]


MAX_TEXT_CHARS = 16 * 1024 * 1024


#: ``DecodeConfig.logprobs``: the most alternatives a step reports (OpenAI's ``top_logprobs`` limit)
MAX_TOP_LOGPROBS = 20


#: the largest image a message or an append carries, encoded (the HTTP front's ``--max-image-bytes`` is lower)
MAX_IMAGE_BYTES = 64 * 1024 * 1024


#: the most images one suffix carries
MAX_SUFFIX_IMAGES = 256


#: a token id a client sends: the engines' ids are 32-bit (one past a model's vocabulary is refused by the model,
#: naming it; one past this is refused at the edge, before it reaches an encoder that cannot hold it)
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Report(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


#: what a model can be asked for (``ActiveModel.capabilities``, ``ModelInfo.capabilities``), read from its weights
#: and its chat template (``backends.tape.model.model_capabilities``): text; images (an image encoder); tools (its
#: template renders a tool list); reasoning (its template renders thinking)
CAPABILITIES = ("text", "vision", "tools", "reasoning")
