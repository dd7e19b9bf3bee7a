"""The tape layer: the one Session implementation over an engine whose KV follows a token tape.

* ``model``   – ``TapeModel`` (the typed seam an engine implements), ``TapeModelBase``
                (the bookkeeping every engine shares) and the rules both engines follow;
* ``session`` – ``TapeSession`` (ensure_prefix, prefill_suffix, decode, snapshot, restore)
                and ``DecodeSteps`` (what an engine supplies per decode pass);
* ``output``  – streamed text post-processing: UTF-8, stop strings, thinking, tool calls;
* ``state``   – the framing of snapshot state bytes and the checks before a restore.

No engine library is imported here.
"""

from .decoding import DecodeSteps
from .model import ChatTemplate, TapeModel, TapeModelBase
from .session import TapeSession

__all__ = ["ChatTemplate", "DecodeSteps", "TapeModel", "TapeModelBase", "TapeSession"]
