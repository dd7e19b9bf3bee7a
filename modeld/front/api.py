"""What the app needs of an HTTP API: its routes, the paths it owns and its error shape, in one entry.

Each API package (``openai``, ``responses``, ``anthropic``) exports ``API``, and
the app mounts the tuple ``app.APIS``: adding an API is its package plus one
entry there. The paths matter because some errors come before any route runs
(a wrong API key, a body past the limit, an unknown path or method, a body that
is not JSON): those are answered in the shape of the API whose prefix the path
starts with, so an Anthropic SDK reads Anthropic's error object on ``/v1/messages``
and an OpenAI SDK OpenAI's elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter
from pydantic import BaseModel

from .core import Serving
from .errors import ApiError
from .stored import ResponseStore

__all__ = ["HttpApi", "error_body"]


@dataclass(frozen=True)
class HttpApi:
    """One HTTP API as the app mounts it."""

    #: its routes over the serving core (and the front's stored responses, for an API that keeps them)
    router: Callable[[Serving, ResponseStore], APIRouter]
    #: the path prefixes of its routes: an error raised before a route runs on such a path is in its shape
    prefixes: tuple[str, ...]
    #: its error object for an ``ApiError`` (the body of every refusal on its paths)
    error: Callable[[ApiError], BaseModel]

    def owns(self, path: str) -> int:
        """How long a prefix of ``path`` this API owns (0: none)."""
        return max((len(p) for p in self.prefixes if path == p or path.startswith(p.rstrip("/") + "/")), default=0)


def error_body(apis: Sequence[HttpApi], path: str, err: ApiError, default: Callable[[ApiError], BaseModel]) -> BaseModel:
    """``err`` in the shape of the API owning ``path`` (the longest prefix wins); ``default``'s for paths no API
    owns (``/``, ``/health``, an unknown route)."""
    best = max(apis, key=lambda api: api.owns(path), default=None)
    render = best.error if best is not None and best.owns(path) else default
    return render(err)
