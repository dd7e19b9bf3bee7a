"""An Evergreen session's nodes and actions, and their rules (the protocol of ``../shared/seeds/002``), apart from
any transport.

A session holds nodes by id. A leaf node is a typed sequence of bytes, sent as chunk fragments; a non-leaf node
lists child node ids. Both may come in several fragments, numbered by ``seq`` within the node, in any order, each
saying whether more follow (``continued``). The rules:

* the first fragment of a ``seq`` wins; a repeat is ignored, not an error (a client may retry);
* metadata (the chunk's MIME type) only at ``seq`` 0: elsewhere it aborts the session;
* a fragment past a node's final one (``continued`` false) aborts the session;
* a node is a leaf or a parent, never both; a node may name children that have not come yet, and be the child of
  several nodes (a DAG), but never contain itself; ``MAX_DEPTH`` levels and ``MAX_BYTES`` inline at most;
* an action names its inputs and outputs as (parameter, node id) pairs; an output id must be new (no node and no
  earlier output has it); a failed action aborts the session.

Everything that aborts raises ``Abort`` with the reason; the transport ends the session with it. A node is
*complete* once its fragments up to the final one have come and, for a parent, every child is complete; an
action runs once its inputs are. ``flatten`` gives a complete node's leaves in order (depth first, children and
chunks by ``seq``).

The mapping onto a conversation (``prompt_messages``): a prompt's leaves in order become chat messages. Text that
an earlier action wrote (its output node, or a node under it) is the assistant's; other text is the user's, one
message until an ``EndOfTurn`` marker or the model's reply. So the seed's second turn, ``prompt_2 = [prompt_1,
response_1, question_2]``, is user, assistant, user: the conversation the daemon already holds plus one question,
and only that question is prefilled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = [
    "END_OF_TURN",
    "MAX_BYTES",
    "MAX_DEPTH",
    "TEXT",
    "Abort",
    "Action",
    "Chunk",
    "Fragment",
    "NodeStore",
]

#: the MIME type of text, the only payload a language model reads or writes here
TEXT = "text/plain"
#: the seed's end-of-turn marker: a chunk with this MIME type and no payload
END_OF_TURN = "application/x-protobuf; type=EndOfTurn"
#: how deep nodes nest at most (a parent's parent's …)
MAX_DEPTH = 64
#: inline payload bytes a session holds at most
MAX_BYTES = 64 * 2**20
#: the actions served, and their parameter names (the seed's examples name them both ways)
ACTIONS = {"GENERATE": ({"prompt", "text"}, {"response", "text"})}


class Abort(Exception):
    """The session ends: a rule was broken (``status`` 400) or an action failed (its HTTP-like status: 404 an
    unknown model, 409 a switch refused, 503 the slot busy or the daemon gone, 500 a failure)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Chunk:
    """A leaf's piece: its MIME type and its payload, inline (``data``) or by reference (``ref``, a URI)."""

    mimetype: str = ""
    data: bytes = b""
    ref: str = ""


@dataclass(frozen=True)
class Fragment:
    """One ``NodeFragment``: a chunk of a leaf (``chunk``; ``has_metadata``: it carried a MIME type) or children of
    a parent (``child_ids``)."""

    id: str
    seq: int = 0
    continued: bool = False
    child_ids: tuple[str, ...] = ()
    chunk: Chunk | None = None
    has_metadata: bool = False


@dataclass(frozen=True)
class Action:
    """An action to run: its name, inputs and outputs as (parameter name, node id), its configuration."""

    name: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    config: dict[str, object] = field(default_factory=dict)


@dataclass
class _Node:
    parent: bool | None = None  # None until its first fragment says
    mimetype: str = ""
    parts: dict[int, Fragment] = field(default_factory=dict)
    final: int | None = None  # the seq of the fragment with continued false
    #: written by an action of this session (its output): its text is the model's
    output: bool = False


class NodeStore:
    """A session's nodes, fed fragment by fragment; not thread-safe (one session, one reader)."""

    def __init__(self, *, allow_file_refs: Path | None = None, max_bytes: int = MAX_BYTES) -> None:
        self._nodes: dict[str, _Node] = {}
        #: output ids actions were given (an output id must be new: never a node's, never given before)
        self._outputs: set[str] = set()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._files = allow_file_refs.resolve() if allow_file_refs is not None else None

    # --- fragments ------------------------------------------------------------------------------------------
    def receive(self, f: Fragment, *, own: bool = False) -> None:
        """Take one fragment (``Abort`` for one that breaks a rule); ``own``: the server's (an action's output),
        the only writer of an output node."""
        if not f.id:
            raise Abort("a node fragment without an id")
        if f.id in self._outputs and not own:
            raise Abort(f"node {f.id!r} is an action's output: only the server writes it")
        if f.seq < 0:
            raise Abort(f"node {f.id!r}: seq {f.seq} is negative")
        if f.chunk is not None and f.child_ids:
            raise Abort(f"node {f.id!r}: a fragment with both a chunk and children")
        node = self._nodes.setdefault(f.id, _Node())
        if f.seq in node.parts:
            return  # the first fragment of a seq wins: a retry is ignored
        if node.final is not None and f.seq > node.final:
            raise Abort(f"node {f.id!r}: fragment {f.seq} came after its final fragment {node.final}")
        if f.has_metadata and f.seq != 0:
            raise Abort(f"node {f.id!r}: metadata in fragment {f.seq} (only fragment 0 carries it)")
        parent = bool(f.child_ids)
        if f.chunk is not None or parent:
            if node.parent is not None and node.parent != parent:
                raise Abort(f"node {f.id!r} is both a leaf and a parent")
            node.parent = parent
        if f.id in f.child_ids:
            raise Abort(f"node {f.id!r} lists itself as a child")
        if f.chunk is not None:
            if f.seq == 0:
                if not f.has_metadata:
                    raise Abort(f"node {f.id!r}: fragment 0 must carry the chunk's metadata (its MIME type)")
                node.mimetype = f.chunk.mimetype
            if f.chunk.ref:
                self._check_ref(f.id, f.chunk.ref)
            self._bytes += len(f.chunk.data)
            if self._bytes > self._max_bytes:
                raise Abort(f"the session's inline payloads passed {self._max_bytes} bytes")
        if not f.continued:
            if any(s > f.seq for s in node.parts):
                raise Abort(f"node {f.id!r}: fragment {f.seq} is final but fragment {max(node.parts)} came before")
            node.final = f.seq
        node.parts[f.seq] = f

    def _check_ref(self, node: str, ref: str) -> None:
        url = urlparse(ref)
        if url.scheme != "file":
            raise Abort(f"node {node!r}: external reference {ref!r}: only file:// references are served")
        if self._files is None:
            raise Abort(f"node {node!r}: file references are refused (serve --allow-file-refs DIR to read them)")
        path = Path(unquote(url.path)).resolve()
        if not path.is_relative_to(self._files):
            raise Abort(f"node {node!r}: {path} is outside the directory file references may read ({self._files})")

    # --- actions --------------------------------------------------------------------------------------------
    def check_action(self, action: Action) -> tuple[str, str]:
        """The action's input and output node ids; ``Abort`` for an action not served, a parameter it does not
        take, or an output id that is not new. Its output ids are taken from then on."""
        spec = ACTIONS.get(action.name)
        if spec is None:
            raise Abort(f"action {action.name!r} is not served (served: {', '.join(sorted(ACTIONS))})")
        ins, outs = spec
        if len(action.inputs) != 1 or action.inputs[0][0] not in ins:
            raise Abort(f"{action.name} takes one input named {' or '.join(sorted(ins))}, got "
                        f"{[n for n, _ in action.inputs]}")
        if len(action.outputs) != 1 or action.outputs[0][0] not in outs:
            raise Abort(f"{action.name} writes one output named {' or '.join(sorted(outs))}, got "
                        f"{[n for n, _ in action.outputs]}")
        out = action.outputs[0][1]
        if not out or out in self._nodes or out in self._outputs:
            raise Abort(f"output id {out!r} is not new: an output must name a node the session has not seen")
        self._outputs.add(out)
        return action.inputs[0][1], out

    def write_output(self, node_id: str, seq: int, text: str, *, final: bool) -> Fragment:
        """A fragment of an action's output (text), kept in the session like any node, so a later prompt can name
        it; the fragment to send."""
        f = Fragment(id=node_id, seq=seq, continued=not final, chunk=Chunk(TEXT, text.encode()), has_metadata=seq == 0)
        self.receive(f, own=True)
        self._nodes[node_id].output = True
        return f

    # --- reading ----------------------------------------------------------------------------------------------
    def complete(self, node_id: str) -> bool:
        """Whether ``node_id`` and everything under it has come (``Abort`` for a cycle or nesting past the
        limit)."""
        return self._complete(node_id, ())

    def _complete(self, node_id: str, path: tuple[str, ...]) -> bool:
        if node_id in path:
            raise Abort(f"node {node_id!r} contains itself ({' -> '.join((*path, node_id))})")
        if len(path) >= MAX_DEPTH:
            raise Abort(f"nodes nest deeper than {MAX_DEPTH} levels")
        node = self._nodes.get(node_id)
        if node is None or node.final is None or len(node.parts) != node.final + 1:
            return False
        if not node.parent:
            return True
        return all(self._complete(c, (*path, node_id)) for c in self._children(node))

    @staticmethod
    def _children(node: _Node) -> Iterable[str]:
        for seq in sorted(node.parts):
            yield from node.parts[seq].child_ids

    def flatten(self, node_id: str) -> list[tuple[Chunk, bool]]:
        """A complete node's leaves' chunks in order (a leaf's chunks joined into one), each with whether an
        action wrote it."""
        out: list[tuple[Chunk, bool]] = []
        self._flatten(node_id, False, out)
        return out

    def _flatten(self, node_id: str, written: bool, out: list[tuple[Chunk, bool]]) -> None:
        node = self._nodes[node_id]
        written = written or node.output
        if node.parent:
            for child in self._children(node):
                self._flatten(child, written, out)
            return
        parts = [node.parts[s].chunk for s in sorted(node.parts)]
        if all(p is None for p in parts):
            return  # a node of empty fragments: nothing to read
        data = b"".join(p.data for p in parts if p is not None)
        refs = [p.ref for p in parts if p is not None and p.ref]
        if refs:
            data = b"".join(Path(unquote(urlparse(r).path)).read_bytes() for r in refs)  # (checked on receipt)
        out.append((Chunk(node.mimetype, data), written))

    def prompt_messages(self, node_id: str) -> list[dict[str, str]]:
        """A complete prompt as chat messages: the model's own text (an action wrote it) as the assistant's, other
        text as the user's, a turn ending at an ``EndOfTurn`` marker or at the model's reply; ``Abort`` for a
        payload that is not text."""
        messages: list[dict[str, str]] = []
        open_role = ""
        for chunk, written in self.flatten(node_id):
            if chunk.mimetype == END_OF_TURN:
                open_role = ""
                continue
            if not chunk.mimetype.startswith(TEXT):
                raise Abort(f"a prompt chunk of type {chunk.mimetype!r}: this model reads {TEXT} only")
            try:
                text = chunk.data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise Abort(f"a {TEXT} chunk that is not UTF-8: {exc}") from None
            role = "assistant" if written else "user"
            if role == open_role and messages:
                messages[-1]["content"] += text
            else:
                messages.append({"role": role, "content": text})
            open_role = role
        if not messages or messages[-1]["role"] != "user":
            raise Abort("the prompt ends without the user's text: there is nothing to answer")
        return messages
