"""An Evergreen session served on the front's serving core: fragments and actions in, output fragments out.

``EvergreenSession.take`` takes what the client sent, in the order it came, and returns the output fragments to
send: an action runs as soon as its input node is complete (before or after the action came), one at a time in
the order the actions came; its output node streams as the reply is written (``text/plain`` fragments, the first
with the MIME type, the last final). The action's prompt is the input's text as a conversation
(``NodeStore.prompt_messages``), so a turn that names the earlier prompt and response is warm: the daemon holds
that conversation and prefills only the new text. Anything that breaks a rule, and any action that fails, raises
``Abort``: the session ends with it.

``config`` keys an action takes: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``,
``stop``, and ``model``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from contract.errors import ModeldError

from ..core import Serving, TurnRequest, decode_options, turn_messages
from ..errors import ApiError, api_error
from .nodes import Abort, Action, Fragment, NodeStore

__all__ = ["CONFIG_KEYS", "EvergreenSession"]

log = logging.getLogger("modeld.evergreen")

#: what an action's ``config`` may set
CONFIG_KEYS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "model"})


class EvergreenSession:
    """One client's session: its nodes, the actions waiting for their inputs."""

    def __init__(self, serving: Serving, *, allow_file_refs: Path | None = None) -> None:
        self.serving = serving
        self.nodes = NodeStore(allow_file_refs=allow_file_refs)
        #: actions taken, not run yet: (action, input id, output id), in arrival order
        self._waiting: list[tuple[Action, str, str]] = []
        #: per run action's output id: the turn's usage (prompt, reused, prefilled, completion tokens)
        self.usage: dict[str, dict[str, int]] = {}

    async def take(self, message: Fragment | Action) -> AsyncIterator[Fragment]:
        """``message``, then the output fragments of every action it made ready, in order."""
        if isinstance(message, Action):
            unknown = sorted(set(message.config) - CONFIG_KEYS)
            if unknown:
                raise Abort(f"{message.name}: config keys {unknown} are not taken (taken: {sorted(CONFIG_KEYS)})")
            inp, out = self.nodes.check_action(message)
            self._waiting.append((message, inp, out))
        else:
            self.nodes.receive(message)
        while self._waiting and self.nodes.complete(self._waiting[0][1]):
            action, inp, out = self._waiting.pop(0)
            async for fragment in self._run(action, inp, out):
                yield fragment

    async def _run(self, action: Action, inp: str, out: str) -> AsyncIterator[Fragment]:
        config = dict(action.config)
        model = str(config.pop("model", "") or "")
        try:
            req = TurnRequest(messages=turn_messages(self.nodes.prompt_messages(inp)), decode=decode_options(**config),
                              model=model)
            turn = await self.serving.abegin(req)
        except ApiError as err:
            raise Abort(f"{action.name} failed: {err.message}", err.status) from None
        seq = 0
        ended = "finish=cancelled error=client_gone"  # (unless the action ends otherwise)
        try:
            async with contextlib.aclosing(turn.aevents()) as events:
                async for event in events:
                    if event.result is not None:
                        u = event.result.usage
                        self.usage[out] = {"prompt_tokens": u.prompt_tokens, "reused_tokens": u.reused_tokens,
                                           "prefilled_tokens": u.prefilled_tokens,
                                           "completion_tokens": u.completion_tokens}
                        ended = f"finish={event.result.finish_reason} " + " ".join(
                            f"{k}={v}" for k, v in self.usage[out].items())
                        continue
                    if event.text:
                        yield self.nodes.write_output(out, seq, event.text, final=False)
                        seq += 1
        except ModeldError as exc:
            failed = api_error(exc)
            ended = f"error={failed.code or failed.status}"
            raise Abort(f"{action.name} failed: {failed.message}", failed.status) from None
        finally:
            await _close(turn)
            log.info("evergreen %s %s %s", action.name, out, ended)
        yield self.nodes.write_output(out, seq, "", final=True)


async def _close(turn: Any) -> None:
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(turn.close)
