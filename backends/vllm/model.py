"""The vLLM engine's model: the daemon's token tape, computed by a vLLM server.

The daemon keeps what it owns on every engine: the manifest, the tape, the chat template, the tool-call parsers,
sessions and fencing, ``modeld why``. The tokenizer and the template are read from the model's GGUF with
llama.cpp's vocabulary loader (no weights: ``Llama(vocab_only=True)``), so a prompt is the same token list as on the
llama.cpp engine, and the load checks that the server tokenizes a probe of the template's markers the same way.

The KV is the server's. ``set_kv`` sends the tape (a completion of one token, thrown away): the server's prefix
cache then holds the prompt's full blocks, and what it held before is the reuse reported (``Link.prefill``). A
decode pass is one streamed completion of the tape (``VLLMSteps``): the server samples, the daemon reads the tokens
one by one, decides where the reply ends (the vocabulary's end-of-generation tokens: the server is told to ignore
its own) and closes the stream there, which stops the server.

Each request names its route (``route_key``), so that a router in front of several servers keeps a conversation on
the server whose prefix cache holds it: the conversation the request names (an agent's session or thread id), else
the head of its prompt (the stable prefix's first block: one agent's conversations, which share it, go where it is
cached).

A decode asked for log probabilities gets the server's figures (the sampled token's and the likeliest, of the raw
distribution, as vLLM reports them by default). What a remote engine cannot do is refused with a typed error, never
faked: structured output and forced tool calls (their masks are the daemon's, per step), readouts, speculation
(the server decodes on its own), an image encoder. A scored prompt (``SuffixInput.logprobs``) is the server's
``prompt_logprobs`` (``_score``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, NoReturn

import httpx
import llama_cpp
import numpy as np
from llama_cpp import Llama

from contract.errors import Internal, ModeldError, SnapshotRejected, UnsupportedFeature
from contract.types import MAX_TOP_LOGPROBS, Config, DecodeConfig, SessionSnapshot, TokenLogprob, TopLogprob

from ..llama.model import VocabTokens, model_template
from ..tape.decoding import DecodeSteps
from ..tape.model import RowsFn, StatesFn, TapeModelBase
from .link import Link, ServerModel, StreamedTokens

__all__ = ["BACKEND_NAME", "VLLMLoadedModel", "VLLMSteps"]

BACKEND_NAME = "vllm"
#: a snapshot of this engine is its tokens: the server's KV is not the daemon's to copy
STATE_KIND = "tokens"


class VLLMLoadedModel(VocabTokens, TapeModelBase):
    """A model a vLLM server computes, with the daemon's tape over it (``VLLMBackend.load`` builds it)."""

    backend_name = BACKEND_NAME

    def __init__(self, vocab: Llama, link: Link, served: ServerModel, *, path: str, digest: str, config: Config,
                 num_ctx: int, requested_template: tuple[str, str] | None = None, owns: bool = True) -> None:
        """``owns``: closing it closes ``vocab`` and ``link`` (the first lane of several owns what they share)."""
        self._owns = owns
        self._llm = vocab
        self._vocab = vocab._model.vocab
        self._n_vocab = int(vocab.n_vocab())
        self.link = link
        self.served = served
        template, self.template_origin = model_template(vocab, requested_template)
        super().__init__(path=path, digest=digest, config=config, num_ctx=num_ctx, resident_bytes=0,
                         template=template, bos_id=int(vocab.token_bos()),
                         adds_bos=bool(llama_cpp.llama_vocab_get_add_bos(self._vocab)))
        #: the prompt tokens the server's prefix cache held at the last prefill (what it did not compute again)
        self.server_cached = 0

    # --- TapeModelBase ------------------------------------------------------------------------
    def engine_version(self) -> str:
        return f"vllm {self.served.version}".strip()

    def runtime_identity(self) -> dict[str, Any]:
        """The server and the model it serves: KV another server computed is never taken for this one's."""
        return {"engine_url": self.link.url, "served_model": self.served.name, "served_root": self.served.root,
                "server_version": self.served.version, "block_size": self.served.block_size}

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    def errors(self, action: str) -> AbstractContextManager[None]:
        return _errors(self.link.url, action)

    def _release(self) -> None:
        if self._owns:
            self.link.close()
            self._llm.close()

    def decode_steps(self, cfg: DecodeConfig) -> DecodeSteps:
        refuse_unserved(cfg)
        return VLLMSteps(self, cfg)

    # --- the server's KV -------------------------------------------------------------------------
    def cache_salt(self) -> str:
        """What the server's prefix cache is keyed by besides the tokens (vLLM's ``cache_salt``): the manifest the
        tape is computed under (``Resident.computing`` while a prefix's prefill runs), so that the server reuses
        KV only where the daemon's manifest gate would, never across manifests on the same tokens."""
        manifest = self.res.computing or self.res.manifest or self.res.partial
        return manifest.digest()[:32] if manifest is not None else "none"

    def route_key(self, tokens: list[int]) -> str:
        """The route of a request for ``tokens`` (``Link``'s ``ROUTE_HEADER``): a digest of the conversation the
        tape is for (``Resident.conversation``, from the request's headers), or of the prompt's first block when it
        names none. A digest: an agent's session id stays on this side."""
        conversation = self.res.conversation
        if conversation:
            seed = f"conversation\0{conversation}".encode()
        else:
            seed = b"head\0" + np.asarray(tokens[: self.served.block_size], dtype="<i4").tobytes()
        return hashlib.sha256(seed).hexdigest()[:32]

    def set_kv(self, tokens: list[int], keep: int, rows: RowsFn | None = None, states: StatesFn | None = None) -> int:
        """Have the server hold ``tokens``; how many it did not compute again: the first ``keep`` while its prefix
        cache still held them (it keeps whole blocks: a partial block's tokens are computed again), fewer where it
        evicted some, more where it held more than the tape (a conversation sent before). The tape is ``tokens``
        once the server computed them; a failure or a cancel leaves it at what the server surely holds (the kept
        part)."""
        if states is not None:
            raise UnsupportedFeature("readouts need the model's hidden states, which a vLLM server does not hand out")
        self.epoch += 1
        keep = min(keep, len(tokens), len(self.res.tokens))
        self.res.tokens = list(tokens[:keep])
        if keep == len(tokens):
            return keep
        if rows is not None:
            self._score(tokens, keep, rows)
            self.res.tokens = list(tokens)
            return keep  # (a scored prompt is computed again by the server, its KV then cached as any other)
        cached = self.link.prefill(self.served.name, list(tokens), self.route_key(tokens), self.cache_salt())
        self.server_cached = cached
        self.res.tokens = list(tokens)
        # The server keeps whole blocks: the kept part's last partial block is computed again on every request, by
        # the engine's design, and counts as kept. Fewer cached than the kept part's whole blocks is the server's
        # own eviction (another client's prompts took the room), and the reuse is what it held. More is the
        # server's cache holding what the tape did not (another conversation's turn was sent since): reused too,
        # as a local engine's workspace cache restores one.
        whole = keep - keep % self.served.block_size
        return max(keep if cached >= whole else cached, min(cached, len(tokens)))

    def _score(self, tokens: list[int], keep: int, rows: RowsFn) -> None:
        """The rows after positions ``keep`` .. the last but one, from the server's figures for the token each row
        predicts (``Link.prompt_logprobs``, ``MAX_TOP_LOGPROBS`` of them). A row holds those figures as they are and
        spreads what probability they leave evenly over the rest of the vocabulary: its log-softmax gives back the
        server's numbers for every token it named, and no other token ranks among them (``_figures_row``)."""
        figures = self.link.prompt_logprobs(self.served.name, list(tokens), MAX_TOP_LOGPROBS, self.route_key(tokens),
                                            self.cache_salt())
        if keep < len(tokens) - 1:
            rows(keep, np.stack([_figures_row(figures[p + 1], self._n_vocab) for p in range(keep, len(tokens) - 1)]))

    def clear_kv(self) -> None:
        """Forget the tape (the server's prefix cache evicts on its own)."""
        self.epoch += 1
        self.res.clear()

    def export_state(self) -> tuple[bytes, str]:
        """A snapshot's state is the tokens alone (the snapshot carries them): the KV is the server's."""
        return b"", STATE_KIND

    def import_state(self, snap: SessionSnapshot, *, backup: bool = True) -> None:
        """The snapshot's tokens computed by the server (its prefix cache may hold them still)."""
        if snap.state_kind != STATE_KIND:
            raise SnapshotRejected(f"state_kind {snap.state_kind!r} is not restorable by the vLLM engine (it "
                                   f"restores {STATE_KIND!r} snapshots: a KV computed elsewhere is not its server's)")
        if snap.state:
            raise SnapshotRejected(f"a {STATE_KIND!r} snapshot carries no state bytes (this one carries "
                                   f"{len(snap.state)}): its tokens are the context")
        self.set_kv(list(snap.resident_token_ids), 0)


def _figures_row(named: dict[int, float], vocab: int) -> np.ndarray:
    """A row of logits whose log-softmax is ``named`` (token id → log probability) for the tokens it names, the
    probability they leave spread evenly over the others (each below every named one: a vocabulary of thousands)."""
    rest = 1.0 - sum(math.exp(v) for v in named.values())
    others = vocab - len(named)
    row = np.full(vocab, math.log(max(rest, 1e-30) / max(others, 1)), dtype=np.float64)
    for token, value in named.items():
        row[token] = value
    return row


def refuse_unserved(cfg: DecodeConfig) -> None:
    """UnsupportedFeature for what a decode asks that the vLLM engine does not serve (module doc)."""
    if cfg.structured_output.is_set():
        raise UnsupportedFeature("structured output and forced tool calls are masked by the daemon at every step; "
                                 "the vLLM engine's server samples on its own")
    if cfg.readouts:
        raise UnsupportedFeature("readouts need the model's hidden states, which a vLLM server does not hand out")


def sampling_body(cfg: DecodeConfig) -> dict[str, Any]:
    """``cfg``'s sampling as vLLM's completion parameters (unset: the server's neutral value)."""
    body: dict[str, Any] = {"temperature": float(cfg.temperature or 0.0)}
    if cfg.temperature:
        if cfg.top_p is not None:
            body["top_p"] = cfg.top_p
        if cfg.top_k:
            body["top_k"] = cfg.top_k
        if cfg.min_p:
            body["min_p"] = cfg.min_p
        if cfg.seed is not None:
            body["seed"] = cfg.seed & 0x7FFFFFFF
    if cfg.repeat_penalty is not None and cfg.repeat_penalty != 1.0:
        body["repetition_penalty"] = cfg.repeat_penalty
    if cfg.frequency_penalty:
        body["frequency_penalty"] = cfg.frequency_penalty
    if cfg.presence_penalty:
        body["presence_penalty"] = cfg.presence_penalty
    return body


class VLLMSteps:
    """One decode pass on the server: a streamed completion of the tape, read a token at a time."""

    def __init__(self, m: VLLMLoadedModel, cfg: DecodeConfig) -> None:
        self.m, self.cfg = m, cfg
        self._stream: StreamedTokens | None = None
        #: tokens the server sent and the pass has not sampled yet, each with its log-probability figures (None
        #: unless asked for)
        self._ready: list[tuple[int, float | None, dict[str, float] | None]] = []
        self._figures: tuple[int, float | None, dict[str, float] | None] = (-1, None, None)

    def start(self) -> None:
        m = self.m
        room = m.num_ctx - len(m.res.tokens)
        if room <= 0:
            return  # the pass ends at the context's end before it samples
        budget = room if self.cfg.max_tokens is None else max(1, min(room, self.cfg.max_tokens + 1))
        body = {"model": m.served.name, "prompt": list(m.res.tokens), "max_tokens": budget, "stream": True,
                "return_token_ids": True, "ignore_eos": True, "skip_special_tokens": False,
                "cache_salt": m.cache_salt(), **sampling_body(self.cfg)}
        if self.cfg.logprobs is not None:
            # the server's own figures: the sampled token's and the likeliest, of the raw distribution (vLLM's
            # default logprobs mode), each keyed by its id
            body |= {"logprobs": self.cfg.logprobs, "return_tokens_as_token_ids": True}
        self._stream = m.link.stream(body, m.route_key(m.res.tokens))
        self._stream.open()

    def sample(self) -> int:
        while not self._ready:
            chunk = self._stream.next() if self._stream is not None else None
            if chunk is None:
                raise Internal("the vLLM server ended a stream before the reply did", url=self.m.link.url)
            for choice in chunk.get("choices") or []:
                ids = [int(t) for t in choice.get("token_ids") or []]
                figures = choice.get("logprobs") or {}
                chosen = figures.get("token_logprobs") or [None] * len(ids)
                tops = figures.get("top_logprobs") or [None] * len(ids)
                self._ready.extend(zip(ids, chosen, tops, strict=False))
        token, chosen, top = self._ready.pop(0)
        self._figures = (token, chosen, top)
        return token

    def token_logprob(self, token: int, row: int | None, k: int) -> TokenLogprob:
        """The figures the server sent with ``token`` (the last sampled): its log probability and the ``k``
        likeliest, likeliest first (the lower id first on a tie)."""
        sampled, chosen, top = self._figures
        if sampled != token or chosen is None:
            raise Internal("the vLLM server sent no log probability for a token it sampled", url=self.m.link.url)
        listed = sorted(((int(key.removeprefix("token_id:")), float(v)) for key, v in (top or {}).items()),
                        key=lambda e: (-e[1], e[0]))[:k]
        piece = self.piece

        def one(t: int, lp: float) -> TopLogprob:
            b = piece(t)
            return TopLogprob(token_id=t, token=b.decode("utf-8", "replace"), bytes=list(b), logprob=lp)

        me = one(token, float(chosen))
        return TokenLogprob(token_id=token, token=me.token, bytes=me.bytes, logprob=me.logprob,
                            top=[one(t, lp) for t, lp in listed])

    def feed(self, token: int) -> None:
        self.m.res.tokens.append(token)  # the server computed it as it sampled the next

    def is_end(self, token: int) -> bool:
        return self.m.is_eog(token)

    def piece(self, token: int) -> bytes:
        return self.m.piece(token)

    def settle(self, token: int) -> None:
        self.m.res.tokens.append(token)

    def verify(self, tokens: list[int]) -> None:
        _no_drafts()

    def sample_row(self, i: int) -> int:
        _no_drafts()

    def rollback(self, n: int) -> None:
        if n:
            _no_drafts()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _no_drafts() -> NoReturn:
    raise Internal("the vLLM engine does not speculate: its server decodes on its own")


@contextlib.contextmanager
def _errors(url: str, action: str) -> Iterator[None]:
    """The engine's one translation of foreign exceptions: the contract's pass, a connection's become Internal."""
    try:
        yield
    except ModeldError:
        raise
    except httpx.HTTPError as exc:
        raise Internal(f"{action}: the vLLM server at {url}: {exc}", url=url) from None
