"""The operator's memory policy: one typed model, the ``memory`` part of ``modeld serve``'s settings.

Where each value comes from (flag, environment, the config file's ``[memory]``
table) is the settings' business (``modeld.settings``): the policy only says
what a value means and which values are valid. Its keys in ``[memory]`` are the
fields' aliases (``max``, ``reserve``, ``headroom``, ``min_context``,
``default_context``); in Python the field names work too.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from .sizes import parse_count, parse_fraction, parse_size

__all__ = ["DEFAULT_CONTEXT", "DEFAULT_HEADROOM_FRACTION", "DEFAULT_MIN_CONTEXT", "Policy"]

#: the window served when the request says 0; 0: as large as fits, up to the model's maximum (agents send
#: first requests of 8k-22k tokens, so a smaller default only turns them away)
DEFAULT_CONTEXT = 0
#: below this many tokens a memory-cut window is refused instead of served
DEFAULT_MIN_CONTEXT = 512
#: fraction of free memory left untouched for allocator slack and estimate error
DEFAULT_HEADROOM_FRACTION = 0.10

Bytes = Annotated[int, BeforeValidator(parse_size)]
Fraction = Annotated[float, BeforeValidator(parse_fraction)]
Tokens = Annotated[int, BeforeValidator(parse_count)]


class Policy(BaseModel):
    """The operator's memory policy.

    * ``user_limit_bytes`` (--mem-max): cap on everything the model uses (weights
      + overhead + KV) in each pool; 0 = no cap.
    * ``reserve_bytes`` (--mem-reserve): memory kept free for everything else.
    * ``headroom_fraction``: share of free memory (incl. the switch credit) kept
      free on top of the reserve, for allocator slack and estimate error; 0.10.
    * ``min_context``: a memory-cut window below this is refused
      (InsufficientMemory) rather than served; 512. A smaller window that was
      asked for (or is the model's maximum) is still served.
    * ``default_context``: the window when the request says 0; 0 (the default)
      means "as large as fits, up to the model's maximum": coding agents send
      first requests of 8k to 22k tokens and rarely ask for a window.

    Sizes are read by ``parse_size`` ("8GiB"), the headroom as 0.1 or "10%".
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True)

    user_limit_bytes: Bytes = Field(0, alias="max", description="memory limit for model + KV, e.g. 8GiB")
    reserve_bytes: Bytes = Field(0, alias="reserve", description="memory kept free, e.g. 1GiB")
    headroom_fraction: Fraction = Field(
        DEFAULT_HEADROOM_FRACTION,
        alias="headroom",
        description="share of free memory kept free on top of the reserve, e.g. 10%",
    )
    min_context: Tokens = Field(DEFAULT_MIN_CONTEXT, description="a memory-cut window below this is refused")
    default_context: Tokens = Field(
        DEFAULT_CONTEXT, description="the window when a request asks for none (0: as large as fits)"
    )
