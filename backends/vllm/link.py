"""The vLLM engine's connection to its server: an OpenAI-compatible vLLM server (or a router in front of several),
spoken to in token ids only.

Three calls carry everything: ``/v1/models`` (what the server serves, its window), ``/tokenize`` (at the load, to
check that the server's tokenizer and the daemon's agree) and ``/v1/completions`` with a list of token ids as its
prompt, streamed, ``return_token_ids`` on (vLLM's extension: each chunk says which tokens it holds, and the first
which prompt tokens the server read). A prefill is a completion of one token whose token is thrown away: the server's
prefix cache then holds the prompt's full blocks, and the decode that follows finds them. The server reports how many
prompt tokens its prefix cache held (``usage.prompt_tokens_details.cached_tokens``, which vLLM leaves out unless it
runs with ``--enable-prompt-tokens-details``): that is the reuse the daemon reports.

A request in flight stops when its connection closes (vLLM aborts a request whose client left): a cancel closes the
stream, and the server stops computing.

Every request names its route (``ROUTE_HEADER``): a router in front of several servers (vLLM's ``vllm-router`` with
``--policy consistent_hash``) sends the requests of one route to one server, the one whose prefix cache holds it.
A single server ignores the header.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from contract import interrupt
from contract.errors import Cancelled, Internal, InvalidArgument, ModeldError, ModelLoadFailed

__all__ = ["ROUTE_HEADER", "Link", "ServerModel", "StreamedTokens"]

# a line per request to the server would drown the daemon's own log
logging.getLogger("httpx").setLevel(logging.WARNING)

#: how long a connection to the server may take; a request's own wait is ``Link.timeout_s``
CONNECT_TIMEOUT_S = 10.0
#: how often a prefill waiting on the server looks at its cancel
CANCEL_POLL_S = 0.05
#: the header a route travels in: ``vllm-router``'s session key (it also reads ``session-id`` and Claude Code's own)
ROUTE_HEADER = "X-Session-ID"
#: the prefix cache's block size where the server does not say it (``Link.cache_config``): vLLM's default on a GPU
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class ServerModel:
    """The model a vLLM server serves, as ``/v1/models`` lists it."""

    #: the name requests give (``--served-model-name``)
    name: str
    #: where the server read it from (a Hugging Face reference or a directory)
    root: str
    #: the window the server runs with (``--max-model-len``)
    max_model_len: int
    #: the server's version, from its ``/version``
    version: str
    #: its prefix cache's block size: it keeps whole blocks of a prompt, and computes a partial one again
    block_size: int = DEFAULT_BLOCK_SIZE
    #: whether it caches prefixes at all (``--enable-prefix-caching``, on by default)
    prefix_caching: bool = True


class Link:
    """An HTTP client for one vLLM server (or router), thread-safe (httpx's client is)."""

    def __init__(self, url: str, *, api_key: str = "", timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))

    def close(self) -> None:
        self._http.close()

    # --- at the load ------------------------------------------------------------------------
    def _get(self, path: str) -> Any:
        try:
            r = self._http.get(path)
        except httpx.HTTPError as exc:
            raise ModelLoadFailed(f"the vLLM server at {self.url} did not answer {path}: {exc}", url=self.url) from None
        if r.status_code != 200:
            raise ModelLoadFailed(f"the vLLM server at {self.url} answered {path} with HTTP {r.status_code}: "
                                  f"{r.text[:300]}", url=self.url, status=r.status_code)
        return r.json()

    def model(self, name: str = "", *, block_size: int | None = None) -> ServerModel:
        """The model the server serves as ``name`` (unset: its only one); ModelLoadFailed when it has none such.
        ``block_size``: the prefix cache's, where the caller knows it (else ``cache_config``'s)."""
        listed = self._get("/v1/models").get("data") or []
        names = [str(m.get("id", "")) for m in listed]
        if name:
            found = [m for m in listed if m.get("id") == name]
        else:
            found = listed if len(listed) == 1 else []
        if not found:
            which = f"no model {name!r}" if name else f"{len(listed)} models, and no served_model was given"
            raise ModelLoadFailed(f"the vLLM server at {self.url} serves {which} (it serves: {', '.join(names)})",
                                  url=self.url, served=names)
        m = found[0]
        try:
            version = str(self._get("/version").get("version", ""))
        except ModelLoadFailed:
            version = ""  # a router may not pass /version on
        published, caching = self.cache_config()
        return ServerModel(name=str(m["id"]), root=str(m.get("root") or m["id"]),
                           max_model_len=int(m.get("max_model_len") or 0), version=version,
                           block_size=block_size or published, prefix_caching=caching)

    def cache_config(self) -> tuple[int, bool]:
        """The prefix cache's block size and whether it is on, from the server's ``vllm:cache_config_info`` metric;
        ``DEFAULT_BLOCK_SIZE`` and on where the server (a router) does not publish it."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            r = self._http.get("/metrics")
            families = list(text_string_to_metric_families(r.text)) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            families = []
        for family in families:
            if family.name == "vllm:cache_config_info" and family.samples:
                labels = family.samples[0].labels
                size = labels.get("block_size", "")
                return (int(size) if size.isdigit() else DEFAULT_BLOCK_SIZE,
                        labels.get("enable_prefix_caching", "True") == "True")
        return DEFAULT_BLOCK_SIZE, True

    def tokenize(self, model: str, text: str) -> list[int]:
        """The server's tokens of ``text`` (special tokens parsed, none added)."""
        r = self._post("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
        return [int(t) for t in r.json()["tokens"]]

    # --- requests -----------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any], route: str = "") -> httpx.Response:
        try:
            r = self._http.post(path, json=body, headers=_routed(route))
        except httpx.HTTPError as exc:
            raise Internal(f"the vLLM server at {self.url} did not answer {path}: {exc}", url=self.url) from None
        if r.status_code != 200:
            raise _refusal(self.url, path, r.status_code, r.text)
        return r

    def prefill(self, model: str, tokens: list[int], route: str = "", salt: str = "") -> int:
        """Have the server compute ``tokens`` (a completion of one token, thrown away); the prompt tokens its prefix
        cache held. A cancel (``contract.interrupt``) closes the request, which stops the server's work on it.
        ``route`` names the request's route (``ROUTE_HEADER``); ``salt`` keys the server's prefix cache besides the
        tokens (vLLM's ``cache_salt``)."""
        body = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, **_salted(salt)}
        cached: list[int] = []
        with self.stream(body, route) as chunks:
            for chunk in chunks:
                usage = chunk.get("usage")
                if usage:
                    cached.append(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        if not cached:
            raise Internal(f"the vLLM server at {self.url} reported no usage for a prefill")
        return cached[-1]

    def prompt_logprobs(self, model: str, tokens: list[int], k: int, route: str = "", salt: str = ""
                        ) -> list[dict[int, float]]:
        """The server's figures for each prompt token given those before it (vLLM's ``prompt_logprobs``): per
        position, the token's own log probability and the ``k`` likeliest, by id; the first position has none (an
        empty mapping). The server computes the prompt again for them (its prefix cache does not keep figures).
        vLLM sends them only in a reply that is not streamed: a cancel waits for it (a scored prompt is short)."""
        body = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k,
                **_salted(salt)}
        choices = self._post("/v1/completions", body, route).json().get("choices") or [{}]
        found = choices[0].get("prompt_logprobs")
        if found is None or len(found) != len(tokens):
            raise Internal(f"the vLLM server at {self.url} sent no prompt log probabilities for {len(tokens)} tokens")
        return [{int(t): float(v["logprob"] if isinstance(v, dict) else v) for t, v in (entry or {}).items()}
                for entry in found]

    def stream(self, body: dict[str, Any], route: str = "") -> StreamedTokens:
        """A streamed ``/v1/completions`` request (``body`` has ``stream`` on) on ``route``; its chunks as dicts."""
        return StreamedTokens(self, body, route)


class StreamedTokens:
    """One streamed completion: its chunks, read on a thread of its own so that the caller's wait for the next one
    can end at a cancel; closing it closes the connection (the server then aborts the request)."""

    def __init__(self, link: Link, body: dict[str, Any], route: str = "") -> None:
        self._link = link
        self._body = body
        self._route = route
        self._cond = threading.Condition()
        self._chunks: list[dict[str, Any]] = []
        self._error: BaseException | None = None
        self._done = False
        self._closed = False
        self._response: httpx.Response | None = None
        self._thread = threading.Thread(target=self._read, name="vllm-stream", daemon=True)

    def __enter__(self) -> Iterator[dict[str, Any]]:
        self.open()
        return self._iter()

    def open(self) -> None:
        """Send the request (its chunks are read from then on)."""
        self._thread.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self) -> None:
        link = self._link
        try:
            with link._http.stream("POST", "/v1/completions", json=self._body, headers=_routed(self._route)) as r:
                if r.status_code != 200:
                    raise _refusal(link.url, "/v1/completions", r.status_code, r.read().decode("utf-8", "replace"))
                with self._cond:
                    self._response = r
                    if self._closed:
                        return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk and "choices" not in chunk:
                        raise _refusal(link.url, "/v1/completions", 500, json.dumps(chunk["error"]))
                    with self._cond:
                        self._chunks.append(chunk)
                        self._cond.notify_all()
        except BaseException as exc:  # handed to the reader (a close's own disconnect is not reported)
            with self._cond:
                if not self._closed:
                    self._error = exc if isinstance(exc, ModeldError) else Internal(
                        f"the vLLM server at {link.url} broke off a stream: {exc}", url=link.url)
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def next(self) -> dict[str, Any] | None:
        """The next chunk; None at the stream's end. Cancelled when a cancel comes while it waits."""
        with self._cond:
            while not self._chunks and not self._done:
                if interrupt.stopped():
                    raise Cancelled("cancelled while the vLLM server computed")
                self._cond.wait(CANCEL_POLL_S)
            if self._chunks:
                return self._chunks.pop(0)
            if self._error is not None:
                raise self._error
            return None

    def _iter(self) -> Iterator[dict[str, Any]]:
        while (chunk := self.next()) is not None:
            yield chunk

    def close(self) -> None:
        with self._cond:
            self._closed = True
            response = self._response
        if response is not None:
            response.close()  # the server sees its client gone and aborts the request


def _salted(salt: str) -> dict[str, str]:
    """A request's cache salt as its body field (none for no salt)."""
    return {"cache_salt": salt} if salt else {}


def _routed(route: str) -> dict[str, str]:
    """A request's route as its header (none for no route)."""
    return {ROUTE_HEADER: route} if route else {}


def _refusal(url: str, path: str, status: int, text: str) -> ModeldError:
    """What a server's HTTP error becomes: the server's own message, its status kept."""
    try:
        message = json.loads(text).get("error", {}).get("message") or text
    except (ValueError, AttributeError):
        message = text
    cls = InvalidArgument if status == 400 else Internal
    return cls(f"the vLLM server at {url} refused {path} (HTTP {status}): {str(message)[:500]}", url=url,
               status=status)
