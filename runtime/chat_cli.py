"""``modeld chat``: a multi-turn conversation with the loaded model, at the terminal or from a file.

Interactive (as people know it from ``ollama run``): type a message, the reply
streams; the history is kept and resent each turn, so the daemon reuses the
whole conversation and prefills only the new message. Commands: ``/clear``
(forget the history), ``/system TEXT`` (a new system prompt; the history is
kept), ``/bye`` (or end of input). Ctrl-C while a reply streams stops that
reply, not the session. After each reply one dim line says how many tokens were
reused and prefilled, the time to first token and the decode rate. A cold
prefill that runs past a couple of seconds shows a progress bar on stderr
(``runtime.progress``) until the reply starts.

One-shot, for scripts: ``modeld chat --messages-file F [--tools-file T] --json``
sends the OpenAI-shaped message list in F (a list, or an object with
``messages`` and optionally ``tools``) and prints the ChatResult.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from contract.errors import InvalidArgument

from .chat import Chat, ChatResult
from .client import Client
from .progress import showing_progress

__all__ = ["add_chat_arguments", "run_chat"]

PROMPT = ">>> "


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default="You are a helpful assistant.", help="system prompt of the conversation")
    p.add_argument("--messages-file", default=None, help="one-shot: a JSON message list (or {messages, tools}) to answer")
    p.add_argument("--tools-file", default=None, help="one-shot: a JSON list of tool definitions")
    p.add_argument("--profile", default="chat", help="the agent's name in the context manifest")
    p.add_argument("--max-tokens", type=int, default=None, help="limit each reply (default: until it ends; Ctrl-C stops one)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: the model's recommended sampling)")
    p.add_argument("--seed", type=int, default=None)


def _decode_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise InvalidArgument(f"{path} is not JSON: {exc}") from exc


def _summary(result: ChatResult) -> str:
    u, t = result.usage, result.timing
    cached = f" ({u.cached_tokens} from the workspace cache)" if u.cached_tokens else ""
    return (
        f"[reused {u.reused_tokens}{cached}, prefilled {u.prefilled_tokens} of {u.prompt_tokens} prompt tokens; "
        f"{u.completion_tokens} tokens, first after {t.ttft_ms:.0f} ms, {t.decode_tokens_per_s:.1f} tok/s; "
        f"{result.finish_reason}]"
    )


def _dim(text: str, stream: TextIO) -> str:
    return f"\x1b[2m{text}\x1b[0m" if stream.isatty() else text


def run_chat(client: Client, args: argparse.Namespace) -> int:
    with Chat(client, profile=args.profile) as chat:
        if args.messages_file:
            return _one_shot(client, chat, args)
        return _repl(client, chat, args, sys.stdin, sys.stdout, sys.stderr)


def _one_shot(client: Client, chat: Chat, args: argparse.Namespace) -> int:
    data = _read_json(args.messages_file)
    messages, tools = (data.get("messages"), data.get("tools")) if isinstance(data, dict) else (data, None)
    if args.tools_file:
        tools = _read_json(args.tools_file)
    if not isinstance(messages, list):
        raise InvalidArgument(f"{args.messages_file} holds no message list")
    with showing_progress(client, enabled=not args.json):
        result = chat.send(messages, tools, **_decode_options(args))
    if args.json:
        print(json.dumps(result.model_dump(mode="json"), indent=2, ensure_ascii=False))
    else:
        msg = result.message
        print(msg.content or "")
        for call in msg.tool_calls:
            print(f"tool call: {call.function.name}({call.function.arguments})")
        print(_dim(_summary(result), sys.stderr), file=sys.stderr)
    return 0


def _repl(client: Client, chat: Chat, args: argparse.Namespace, stdin: TextIO, out: TextIO, err: TextIO) -> int:
    system = args.system
    history: list[dict[str, Any]] = []
    interactive = stdin.isatty()
    while True:
        if interactive:
            out.write(PROMPT)
            out.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/bye":
            break
        if text.strip() == "/clear":
            history.clear()
            print(_dim("[history cleared]", err), file=err)
            continue
        if text.startswith("/system"):
            system = text[len("/system") :].strip()
            print(_dim("[system prompt set]", err), file=err)
            continue
        if text.startswith("/"):
            print(_dim("[commands: /clear, /system TEXT, /bye]", err), file=err)
            continue
        history.append({"role": "user", "content": text})
        result = _reply(client, chat, [{"role": "system", "content": system}, *history], args, out, err)
        if result is None:  # stopped by Ctrl-C: the question stays, the partial answer does not
            continue
        reply: dict[str, Any] = {"role": "assistant", "content": result.message.content or ""}
        if result.message.tool_calls:
            reply["tool_calls"] = [c.model_dump(mode="json") for c in result.message.tool_calls]
        history.append(reply)
    return 0


def _reply(
    client: Client, chat: Chat, messages: list[dict[str, Any]], args: argparse.Namespace, out: TextIO, err: TextIO
) -> ChatResult | None:
    result: ChatResult | None = None
    with showing_progress(client, enabled=not args.json, stream=err) as bar:
        stream = chat.stream(messages, **_decode_options(args))
        try:
            for event in stream:
                bar.close()  # the prefill is over: the reply streams below it
                if event.result is not None:
                    result = event.result
                    break
                if event.text:
                    out.write(event.text)
                    out.flush()
        except KeyboardInterrupt:
            stream.close()  # cancels the decode within one token
            bar.close()
            out.write("\n")
            print(_dim("[stopped]", err), file=err)
            return None
        finally:
            stream.close()
    out.write("\n")
    if result is not None:
        print(_dim(_summary(result), err), file=err)
    return result
