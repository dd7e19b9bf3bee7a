"""Client commands of the ``modeld`` CLI: status, load, unload, describe, embed, run, chat, completion.

Every command takes ``--endpoint`` and ``--json``. Human output is an aligned
table; on failure the exit code is non-zero and stderr names the error class
and its message. A load or a cold prefill that runs past a couple of seconds
shows a progress bar on stderr when it is a terminal (``runtime.progress``);
``--json`` never does. ``modeld completion bash|zsh`` prints a completion
script generated from these parsers, ``serve``'s and ``prepare``'s included.

Over ~400 lines on purpose: one parser and one printer per client command, a few dozen lines each,
sharing the connection, progress and table helpers.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.errors import InvalidArgument, ModeldError
from contract.types import (
    ActiveModel,
    DaemonStatus,
    DecodeConfig,
    DeviceInfo,
    EmbedRequest,
    LoadModelRequest,
    OpenSessionRequest,
    PrefixInput,
    ReuseMiss,
    RunningTurn,
    SamplingParams,
    SpeculationStatus,
    SuffixInput,
    UnloadModelRequest,
    format_gpu_layers,
)

from .chat_cli import add_chat_arguments, run_chat
from .client import Client
from .flags import OptionFlag, add_load_flags, load_config
from .progress import showing_progress

EXIT_ERROR = 1
EXIT_USAGE = 2


def _table(rows: list[tuple[str, Any]]) -> str:
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k.ljust(width)}  {'' if v is None else v}" for k, v in rows)


def _version() -> str:
    try:
        return importlib.metadata.version("modeld")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "(not installed)"


def size_text(n: int) -> str:
    """Bytes in binary units, as people read them (``1.5 GiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _duration(seconds: float) -> str:
    """A duration as people read it: ``42s``, ``5m 07s``, ``2h 03m``, ``3d 04h``."""
    s = max(0, int(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {s:02d}s"
    return f"{s}s"


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False)


def _print_json(obj: Any) -> None:
    print(_json_text(obj))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default=None, help="daemon endpoint (default: env MODELD_ENDPOINT or the per-user ipc socket)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--owner", default=os.environ.get("MODELD_OWNER", ""), help="owner fence (env MODELD_OWNER)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the daemon")
    p.add_argument("--server-key", default=None,
                   help="the daemon's CURVE public key for a --curve tcp endpoint (env MODELD_SERVER_KEY)")


def _model_args(p: argparse.ArgumentParser, command: str, options: Sequence[OptionFlag]) -> None:
    """The model a command names and what its load takes (``runtime.flags``: ``Config``'s flags and the engines'
    options, declared once there)."""
    p.add_argument("--path", default="", help="GGUF file or OpenVINO IR directory")
    p.add_argument("--type", default="", help="backend type: llama | openvino | vllm | memory")
    p.add_argument("--digest", default="", help="expected content digest (sha256:…)")
    add_load_flags(p, command, options)


#: the daemon's own commands, run by ``modeld.cli``: name → what the top-level help says of it
_DAEMON_COMMANDS = {
    "serve": "run the daemon", "prepare": "convert the bundled models once",
    "http": "the OpenAI-compatible API alone, for a running daemon",
    "keys": "print the daemon's CURVE public key for --curve tcp endpoints",
    "feedback": "the ratings clients sent over the WebSocket protocol",
    "pull": "download a model into the store: user/repo:QUANT, user/repo/FILE.gguf or a path",
    "ls": "list the stored models", "show": "one stored model in detail", "rm": "delete a stored model",
    "alias": "another name for a stored model",
}


def _daemon_commands(sub: Any, own: Mapping[str, argparse.ArgumentParser]) -> None:
    """The daemon's commands as names, each with its own parser's options where ``own`` has it (completion)."""
    for name, what in _DAEMON_COMMANDS.items():
        sub.add_parser(name, help=f"{what} (see `modeld {name} --help`)", add_help=False,
                       parents=[own[name]] if name in own else [])


def build_parser(
    daemon_parsers: Mapping[str, argparse.ArgumentParser] | None = None, options: Sequence[OptionFlag] = (),
) -> argparse.ArgumentParser:
    """The client commands' parser; ``serve`` and friends are names only (``modeld.cli`` runs them).

    ``daemon_parsers`` (name -> that command's own parser) gives those names
    their options, for the completion script (``completion_parser``); ``options``: the engines' load options as
    flags of the commands that name a model (``Extensions.options``).
    """
    p = argparse.ArgumentParser(prog="modeld", description="A local model daemon for coding agents.")
    p.add_argument("--version", action="version", version=f"modeld {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _daemon_commands(sub, daemon_parsers or {})

    s = sub.add_parser("status", help="show the slot state")
    _common(s)

    s = sub.add_parser("load", help="load (or switch to) a model: a stored one by name (modeld ls), or --path")
    s.add_argument("name", help="a model in the daemon's store (name, alias or the reference it was pulled by), "
                   "or the logical name of the model at --path")
    _model_args(s, "load", options)
    s.add_argument("--pull", action="store_true",
                   help="NAME is a Hugging Face reference (user/repo:QUANT) not yet in the store: pull it first")
    s.add_argument("--data-dir", default=None,
                   help="with --pull: the daemon's data dir, whose models/ the pull fills (default: as `modeld serve` "
                   "resolves it: $MODELD_DATA_DIR, else the config file's data_dir, else the platform's)")
    s.add_argument("--expected-generation", type=int, default=0)
    _common(s)

    s = sub.add_parser("unload", help="release the slot")
    s.add_argument("--expected-generation", type=int, default=0)
    _common(s)

    s = sub.add_parser("describe", help="model capabilities and memory fit")
    s.add_argument("name", nargs="?", default="")
    _model_args(s, "describe", options)
    _common(s)

    s = sub.add_parser("embed", help="embed texts")
    s.add_argument("texts", nargs="+", metavar="TEXT")
    _model_args(s, "embed", options)
    s.add_argument("--truncate", action="store_true", help="truncate texts longer than the model window")
    _common(s)

    s = sub.add_parser("run", help="one hot-loop turn: system prefix, prompt, streamed answer")
    s.add_argument("prompt")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--system", default=None)
    g.add_argument("--system-file", default=None)
    s.add_argument("--max-tokens", type=int, default=None, help="limit the reply (default: until it ends)")
    s.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: the model's recommended sampling, see `modeld status`)")
    s.add_argument("--seed", type=int, default=None)
    _model_args(s, "run", options)
    _common(s)

    s = sub.add_parser("takeover", help="become the daemon's owner (--owner) at a higher --epoch; the old owner's session ends")
    s.add_argument("--epoch", type=int, required=True, help="the new owner epoch (higher than status shows)")
    _common(s)

    s = sub.add_parser("cancel", help="end the turn that holds the slot (status shows it): its prefill or decode "
                       "stops, keeping what it computed, and its session is released")
    s.add_argument("--session", default="", help="the turn of this session instead (status --json: turn.session_id)")
    _common(s)

    s = sub.add_parser("metrics", help="the daemon's metrics in the Prometheus text format")
    _common(s)

    s = sub.add_parser("why", help="the last requests' prompts: how much was reused, and where and why it stopped")
    s.add_argument("last", nargs="?", type=int, default=20, help="how many requests (default 20, at most 256)")
    _common(s)

    s = sub.add_parser("cache", help="the workspace cache of prefix states: ls (list) or clear")
    s.add_argument("action", choices=("ls", "clear"))
    _common(s)

    s = sub.add_parser("chat", help="a multi-turn conversation with the loaded model (or --messages-file F --json)")
    add_chat_arguments(s)
    _common(s)

    s = sub.add_parser("completion", help="print a shell completion script: eval \"$(modeld completion bash)\"")
    s.add_argument("shell", choices=COMPLETION_SHELLS)
    return p


#: the commands that name a model and take what a load takes (``_model_args``)
MODEL_COMMANDS = ("load", "describe", "embed", "run")
#: the shells ``modeld completion`` writes a script for
COMPLETION_SHELLS = ("bash", "zsh")
#: options that name a file or a directory (the shell completes paths there)
_FILE_OPTIONS = frozenset({"path", "system_file", "messages_file", "tools_file", "model", "gguf"})
_DIR_OPTIONS = frozenset({"data_dir", "cache_dir"})


@dataclass(frozen=True)
class Extensions:
    """What the daemon's install adds to the client commands: ``modeld.cli`` passes them, so this module imports
    nothing of the daemon (a client-only install has none: completion covers the client commands, and
    ``load --pull`` says which install pulls)."""

    #: the daemon-side commands' parsers by name (``serve``, ``prepare``, ``keys``, ``http``, the store's), for the
    #: completion script
    parsers: Callable[[], Mapping[str, argparse.ArgumentParser]] | None = None
    #: ``load NAME --pull``: NAME into the store under the data dir (None: the default one); the name to load
    pull: Callable[[str, Path | None], str] | None = None
    #: the installed engines' load options, each a flag of the commands that name a model (``runtime.flags``)
    options: Callable[[], list[OptionFlag]] | None = None


def completion_parser(ext: Extensions | None = None) -> argparse.ArgumentParser:
    """The whole command tree for completion: the client commands, and the options of the commands
    ``ext.parsers`` names (so completion follows their options)."""
    parsers = ext.parsers() if ext is not None and ext.parsers is not None else None
    return build_parser(parsers, ext.options() if ext is not None and ext.options is not None else ())


def completion_script(shell: str, ext: Extensions | None = None) -> str:
    """The completion script for ``shell`` (``COMPLETION_SHELLS``), generated by shtab from ``completion_parser``."""
    if shell not in COMPLETION_SHELLS:
        raise InvalidArgument(f"no completion for {shell!r}; one of: {', '.join(COMPLETION_SHELLS)}")
    try:
        import shtab
    except ImportError as exc:
        raise ImportError(
            "shell completion needs shtab: pip install 'modeld[cli]' (or pip install shtab==1.13.0)"
        ) from exc
    parser = completion_parser(ext)
    for action in _actions(parser):
        dest = action.dest
        if dest in _FILE_OPTIONS:
            action.complete = shtab.FILE  # type: ignore[attr-defined]  # shtab reads this attribute
        elif dest in _DIR_OPTIONS:
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
    script: str = shtab.complete(parser, shell=shell)
    return script


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every option of ``parser`` and of its subcommands."""
    found: list[argparse.Action] = []
    for action in parser._actions:
        found.append(action)
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                found += _actions(child)
    return found


def _completion(args: argparse.Namespace, ext: Extensions) -> int:
    try:
        sys.stdout.write(completion_script(args.shell, ext))
    except ImportError as exc:
        print(f"modeld: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return 0


def main(argv: list[str] | None = None, ext: Extensions | None = None) -> int:
    """The client commands; ``ext``: what the daemon's install adds (``modeld.cli`` passes it)."""
    ext = ext or Extensions()
    options = ext.options() if ext.options is not None else []
    parser = build_parser(options=options)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command in MODEL_COMMANDS:
        try:
            args.handle = model_handle(args, options)
        except ValueError as exc:  # a value its field refuses (pydantic's message names it), a malformed pair
            parser.error(str(exc))
    if args.command == "completion":  # needs no daemon
        return _completion(args, ext)
    client = Client(args.endpoint, timeout_s=args.timeout, owner=args.owner, server_key=args.server_key)
    try:
        if args.command == "load":
            return _load(client, args, ext.pull)
        return int(_COMMANDS[args.command](client, args))
    except ModeldError as exc:
        if getattr(args, "json", False):
            _print_json({"error": exc.to_wire()})
        print(f"modeld: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `modeld status --json | head`
        sys.stderr.close()
        return 0
    finally:
        client.close()


def _cancel(client: Client, args: argparse.Namespace) -> int:
    reply = client.cancel_turn(args.session)
    if args.json:
        _print_json(reply.model_dump(mode="json"))
    elif reply.session_id:
        print(f"ended the turn of session {reply.session_id[:8]}" + (f" ({reply.client})" if reply.client else ""))
    else:
        print("no turn holds the slot" if not args.session else f"session {args.session} holds no turn")
    return 0


def _status(client: Client, args: argparse.Namespace) -> int:
    print(status_text(client.status(), client.endpoint, as_json=args.json))
    return 0


def status_text(st: DaemonStatus, endpoint: str = "", *, as_json: bool = False) -> str:
    """What ``modeld status`` prints for ``st`` (the daemon's own endpoint, else ``endpoint``): a table of rows,
    or the status as JSON."""
    if as_json:
        return _json_text(st.model_dump(mode="json"))
    rows: list[tuple[str, Any]] = [
        ("endpoint", st.endpoint or endpoint),
        ("backend", f"{st.backend} {st.backend_version}".strip() + (f" ({st.backend_reason})" if st.backend_reason else "")),
        ("state", st.state.value),
        ("generation", st.generation),
        ("owner", f"{st.owner_instance_id} (epoch {st.owner_epoch})" if st.owner_instance_id else "-"),
        ("session open", ("yes" if st.session_open else "no") if st.session_lanes <= 1
         else f"{st.sessions_open} of {st.session_lanes} at once"),
    ]
    if st.pid:
        rows.append(("pid", st.pid))
    if st.uptime_s:  # (a daemon from before uptime was reported sends none)
        rows.append(("uptime", _duration(st.uptime_s)))
    if st.busy_operation:
        rows.append(("busy", st.busy_operation))
    if st.turns:
        rows += [("turn", turn_text(t)) for t in st.turns]
    elif st.turn is not None:
        rows.append(("turn", turn_text(st.turn)))
    if st.waiting:
        rows.append(("waiting", f"{st.waiting} session(s) for the slot"))
    if st.load_progress is not None:
        rows.append(("load progress", f"{st.load_progress * 100:.0f}%"))
    if st.active:
        rows += [
            ("model", st.active.model_name),
            ("path", st.active.path),
            ("digest", st.active.digest),
            ("context", st.active.effective_context),
            ("resident bytes", st.active.resident_bytes),
        ]
        if st.active.chat_template:
            rows.append(("chat template", st.active.chat_template))
        if st.active.tool_format:
            rows.append(("tool calls", st.active.tool_format))
        rows.append(("capabilities", ", ".join(st.active.capabilities)))
        cfg = st.active.config
        chosen = [name for name, on in (("flash attention", cfg.flash_attn),
                                        (f"KV cache {cfg.kv_cache_type}", bool(cfg.kv_cache_type)),
                                        ("exact decode", cfg.exact_decode),
                                        ("exact reuse", cfg.exact_reuse),
                                        (f"{cfg.num_threads} threads", bool(cfg.num_threads))) if on]
        chosen += [f"{name}={value}" for name, value in sorted(cfg.options.items())]
        if chosen:
            rows.append(("settings", ", ".join(chosen)))
        rows.append(("gpu layers", _gpu_layers_row(st.active)))
    rows += _gpu_rows(st)
    if st.sampling is not None:
        rows.append(("sampling", _sampling_row(st.sampling)))
    if st.speculation is not None:
        rows += _speculation_rows(st.speculation)
    if st.embedding is not None:
        rows += _embedding_rows(st.embedding)
    if st.cache is not None:
        c = st.cache
        hit_rate = c["hit_rate"]
        rate = "-" if hit_rate is None else f"{hit_rate * 100:.0f}%"
        rows += [
            ("cache ram", f"{c['ram_entries']} entries, {size_text(c['ram_bytes'])} of {size_text(c['ram_budget_bytes'])}"),
            ("cache disk", f"{c['disk_entries']} entries, {size_text(c['disk_bytes'])} of {size_text(c['disk_budget_bytes'])}"
                           + (f" in {c['disk_dir']}" if c["disk_dir"] else "")),
            ("cache hits", f"{c['hits']} of {c['hits'] + c['misses']} switches ({rate}), "
                           f"{c['restored_tokens']} tokens restored"),
        ]
        if c["rejected"]:
            rows.append(("cache rejected", f"{c['rejected']} (last: {c['last_rejection']})"))
    if st.idle_s is not None:
        rows.append(("idle", f"{st.idle_s:.0f} s" + (f" (unloads after {st.idle_unload_s:.0f} s)" if st.idle_unload_s else "")))
    if st.blobs is not None:
        b = st.blobs
        rows.append(("snapshot blobs", f"{b['blobs']}, {size_text(b['bytes'])} of {size_text(b['max_bytes'])} (pruned {b['pruned']})"))
    if st.models is not None:
        m = st.models
        rows.append(("model store", f"{m['models']} models, {size_text(m['bytes'])} in {m['dir']}"))
    if st.last_error:
        rows.append(("last error", st.last_error))
    return _table(rows)


def turn_text(t: RunningTurn) -> str:
    """The turn that holds the slot, in a line: whose, how old, what it does and how far it came."""
    who = t.client or f"session {t.session_id[:8]}"
    if t.phase == "prefill":
        what = f"prefill, {t.done:,} of {t.total:,} tokens in the context ({t.reused:,} were reused)"
    elif t.phase == "decode":
        what = f"decode, {t.done:,} tokens written"
    elif t.phase == "idle":
        what = "idle (its client runs no operation)"
    else:
        what = t.phase
    running = f" for {_duration(t.operation_s)}" if t.operation else ""
    return f"{who}: {what}{running}; held {_duration(t.age_s)} (modeld cancel ends it)"


def _device_row(d: DeviceInfo) -> str:
    return f"{d.name or d.kind + ':' + d.id}, {size_text(d.free_bytes)} free of {size_text(d.total_bytes)}"


def _device_rows(devices: list[DeviceInfo]) -> list[tuple[str, Any]]:
    """One row per device (``describe``: host RAM and the GPUs the plan may use)."""
    return [(f"{d.kind} {d.id}", _device_row(d)) for d in devices]


def _gpu_rows(st: DaemonStatus) -> list[tuple[str, Any]]:
    """The machine's GPUs, whether the engine's build uses them, and the build (status)."""
    rows: list[tuple[str, Any]] = [(f"gpu {d.id}", _device_row(d)) for d in st.devices] or [("gpus", "none")]
    if st.devices and not st.gpu_offload:
        rows.append(("gpu offload", f"no: this {st.backend} build has no GPU backend (the CPU serves)"))
    elif st.devices:
        rows.append(("gpu offload", "yes"))
    if st.build:
        rows.append(("build", st.build))
    return rows


def _gpu_layers_row(active: ActiveModel) -> str:
    """"30 of 30 (all)", "12 of 30 (gpu memory)", "0 (no gpu)"; what the daemon resolved the request to."""
    if not active.gpu_layers_reason:  # a daemon that does not plan layers says only the count
        return format_gpu_layers(active.config.num_gpu_layers)
    of = f" of {active.n_layer}" if active.gpu_layers and active.n_layer else ""
    return f"{active.gpu_layers}{of} ({active.gpu_layers_reason})"


def _sampling_row(sp: SamplingParams) -> str:
    """What a request that sets no sampling parameter gets, and where that came from."""
    if sp.temperature == 0:
        what = "greedy"
    else:
        parts = [f"temperature {sp.temperature:g}" if sp.temperature is not None else "temperature -"]
        parts += [f"{name.replace('_', '-')} {value:g}" for name in ("top_k", "top_p", "min_p")
                  if (value := getattr(sp, name)) is not None]
        if sp.repeat_penalty is not None and sp.repeat_penalty != 1.0:
            parts.append(f"repeat-penalty {sp.repeat_penalty:g} over the last {sp.repeat_last_n or 64}")
        what = ", ".join(parts)
    where = {"model": "the model's recommendation", "default": "the defaults", "settings": "--temperature"}
    return f"{what} when a request sets none ({where.get(sp.source, sp.source or 'unset')})"


def _speculation_rows(sp: SpeculationStatus) -> list[tuple[str, Any]]:
    """How the loaded model drafts: the default, what a check costs here, and the drafts kept so far."""
    # where rows are exact a sampled decode drafts too: its batch rounds as its steps do
    what = (("on for greedy and sampled decodes" if sp.rows_exact else "on for greedy decodes") if sp.enabled
            else "off unless a request asks")
    if sp.check_costs:
        rows = " / ".join(sp.check_costs)
        steps = " / ".join(f"{c:.2f}" for c in sp.check_costs.values())
        what += f"; a check of {rows} rows costs {steps} one-token steps"
        if sp.check_growth_per_1k:
            what += f" (16 rows: +{sp.check_growth_per_1k:.2f} per 1,000 tokens of context)"
        what += (", measured on this machine" if sp.measured
                 else ", a prior until timed (when the slot is idle)" if sp.pending else ", a prior (not measured)")
    kept = (f"{sp.accepted_tokens} of {sp.drafted_tokens} drafted tokens kept "
            f"({sp.accepted_tokens / sp.drafted_tokens:.0%})" if sp.drafted_tokens else "none drafted yet")
    out: list[tuple[str, Any]] = [("speculation", what), ("drafts", kept)]
    if sp.rows_probe or sp.rows_exact:
        # whether a batch's rows round as one-token steps do: sampled decodes draft too, reuse is exact
        out.append(("exact rows", ("yes" if sp.rows_exact else "no") + (f": {sp.rows_probe}" if sp.rows_probe else "")))
    return out


def _embedding_rows(e: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The embedding side slot (``EmbeddingStatus``): its model, when loaded, and its use."""
    if e.get("loaded"):
        what = (f"{e.get('model_name') or e.get('path', '')} ({e.get('backend', '')}, {e.get('dims', 0)} dims, "
                f"window {e.get('window', 0)}), {size_text(e.get('resident_bytes', 0))}")
    else:
        what = f"not loaded ({e.get('backend', '')}; loads on the first embed)"
    rows: list[tuple[str, Any]] = [("embedding", what)]
    use = f"{e.get('embedded_inputs', 0)} inputs embedded, {e.get('loads', 0)} loads"
    if e.get("idle_s") is not None:
        use += f"; idle {_duration(e['idle_s'])}"
        if e.get("idle_unload_s"):
            use += f" (unloads after {_duration(e['idle_unload_s'])})"
    rows.append(("embedding use", use))
    if e.get("last_error"):
        rows.append(("embedding error", e["last_error"]))
    return rows


def _takeover(client: Client, args: argparse.Namespace) -> int:
    r = client.takeover(args.epoch)
    if args.json:
        _print_json(r.model_dump(mode="json"))
    else:
        print(_table([("owner", r.owner), ("epoch", r.epoch), ("ended a session", "yes" if r.ended_session else "no")]))
    return 0


def _metrics(client: Client, args: argparse.Namespace) -> int:
    sys.stdout.write(client.metrics())
    return 0


def _why(client: Client, args: argparse.Namespace) -> int:
    records = client.why(args.last)
    if args.json:
        _print_json([r.model_dump(mode="json") for r in records])
        return 0
    if not records:
        print("(no requests yet)")
        return 0
    print(f"{'WHEN':8}  {'PROMPT':>7}  {'REUSED':>7}  {'CACHED':>7}  {'PREFILL':>7}  {'SECONDS':>7}  WHY NOT ALL")
    for r in records:
        when = time.strftime("%H:%M:%S", time.localtime(r.at))
        print(f"{when:8}  {r.prompt_tokens:>7}  {r.reused_tokens:>7}  {r.cached_tokens:>7}  {r.prefilled_tokens:>7}  "
              f"{r.prefill_ms / 1000:>7.1f}  {_why_line(r.miss)}")
    return 0


def _why_line(miss: ReuseMiss | None) -> str:
    """``cause at token N (message M): detail`` and the two sides where they part."""
    if miss is None:
        return "-"
    where = f"{miss.cause.value} at token {miss.index}" + (f" (message {miss.message})" if miss.message >= 0 else "")
    line = f"{where}: {miss.detail}" if miss.detail else where
    if miss.held_text or miss.new_text:
        line += f"\n{'':57}held {miss.held_text!r}\n{'':57}new  {miss.new_text!r}"
    return line


def _cache(client: Client, args: argparse.Namespace) -> int:
    if args.action == "clear":
        n = client.cache_clear()
        if args.json:
            _print_json({"cleared": n})
        else:
            print(f"cleared {n} workspace cache entries")
        return 0
    listing = client.cache_list()
    if args.json:
        _print_json(listing.model_dump(mode="json"))
        return 0
    if listing.cache is None:
        print("the workspace cache is off (modeld serve --cache-ram 0 --cache-disk 0, or the memory backend)")
        return 0
    now = time.time()
    print(f"{'ID':16}  {'BACKEND':8}  {'TOKENS':>6}  {'PREFIX':>6}  {'SIZE':>9}  {'WHERE':8}  {'LAST USED':9}  CONVERSATION")
    for e in listing.entries:
        age = max(0.0, now - e.last_used)
        ago = f"{age:.0f}s ago" if age < 120 else f"{age / 60:.0f}m ago" if age < 7200 else f"{age / 3600:.0f}h ago"
        print(f"{e.id:16}  {e.backend:8}  {e.tokens:>6}  {e.prefix_tokens:>6}  {size_text(e.bytes):>9}  {e.where:8}  "
              f"{ago:9}  {e.conversation[:36] or '-'}")
    if not listing.entries:
        print("(no entries)")
    return 0


def model_handle(args: argparse.Namespace, options: Sequence[OptionFlag] = ()) -> dict[str, Any]:
    """The model a command's flags name, with its load config: the fields of a load, describe or open request.
    Only load and describe take --gpu-layers: another command's config keeps the wire's default (what is loaded).
    ValueError (pydantic's among them) for a malformed value."""
    given = vars(args)
    if given.get("chat_template"):
        given = {**given, "chat_template": _template_arg(given["chat_template"])}
    return {
        "model_name": getattr(args, "name", "") or "",
        "type": args.type,
        "digest": args.digest,
        "path": os.path.abspath(args.path) if args.path and args.type != "memory" else args.path,
        "config": load_config(given, args.command, options),
    }


def _template_arg(value: str) -> str:
    """A template file named relative to this shell is sent as an absolute path (the daemon's cwd is its own)."""
    return os.path.abspath(value) if value and os.path.exists(value) else value


def _load(client: Client, args: argparse.Namespace, pull: Callable[[str, Path | None], str] | None = None) -> int:
    if args.pull and not args.path:
        if pull is None:
            print("modeld load --pull: the pull needs the daemon's install (pip install 'modeld[server]'), which puts "
                  "the model in its store", file=sys.stderr)
            return EXIT_ERROR
        try:
            # NAME into the store unless it is there (the daemon then loads it by name)
            args.name = pull(args.name, Path(args.data_dir) if args.data_dir else None)
        except ImportError as exc:
            print(f"modeld load --pull: {exc.name or exc} is not installed: the pull needs the daemon's install "
                  "(pip install 'modeld[server]')", file=sys.stderr)
            return EXIT_ERROR
        except (ValueError, RuntimeError) as exc:  # the store's and the pull's errors say why
            print(f"modeld load: {exc}", file=sys.stderr)
            return EXIT_ERROR
    req = LoadModelRequest(**{**args.handle, "model_name": args.name}, expected_generation=args.expected_generation)
    with showing_progress(client, enabled=not args.json):
        active = client.load_model(req)
    if args.json:
        _print_json(active.model_dump(mode="json"))
    else:
        print(_table([("model", active.model_name), ("generation", active.generation), ("digest", active.digest),
                      ("context", active.effective_context), ("gpu layers", _gpu_layers_row(active))]))
    return 0


def _unload(client: Client, args: argparse.Namespace) -> int:
    client.unload_model(UnloadModelRequest(expected_generation=args.expected_generation))
    st = client.status()
    if args.json:
        _print_json({"state": st.state.value, "generation": st.generation})
    else:
        print(_table([("state", st.state.value), ("generation", st.generation)]))
    return 0


def _describe(client: Client, args: argparse.Namespace) -> int:
    info = client.describe(OpenSessionRequest(**args.handle))
    if args.json:
        _print_json(info.model_dump(mode="json"))
    else:
        rows = [(k, ", ".join(v) if k == "capabilities" else v)
                for k, v in info.model_dump(mode="json", exclude={"devices", "engine_options"}).items()
                if v not in (None, "", [], 0, False)]
        rows += _device_rows(info.devices)
        rows += [(f"option {o.name}", f"{'|'.join(o.choices) or o.type}, default {o.default}: {o.description}")
                 for o in info.engine_options]
        print(_table(rows))
    return 0


def _embed(client: Client, args: argparse.Namespace) -> int:
    res = client.embed(EmbedRequest(**args.handle, texts=list(args.texts), truncate=args.truncate))
    if args.json:
        _print_json({"vectors": res.vectors, "dims": res.dims, "model_name": res.model_name})
        return 0
    for text, vec in zip(args.texts, res.vectors, strict=True):
        norm = math.sqrt(sum(x * x for x in vec))
        head = ", ".join(f"{x:+.4f}" for x in vec[:4])
        short = text if len(text) <= 40 else text[:37] + "..."
        print(f"{short!r}: dims={len(vec)} norm={norm:.4f} [{head}, …]")
    return 0


def _run(client: Client, args: argparse.Namespace) -> int:
    system = args.system
    if args.system_file:
        with open(args.system_file, encoding="utf-8") as f:
            system = f.read()
    with showing_progress(client, enabled=not args.json):  # an auto-load, the prefills
        sess = client.open_session(OpenSessionRequest(**args.handle))
        t0 = time.perf_counter()  # the turn: prefix, suffix, first token
        try:
            manifest = sess.manifest()
            pre = sess.ensure_prefix(PrefixInput(text=system or "", manifest=manifest))
            suf = sess.prefill_suffix(SuffixInput(text=args.prompt, manifest=manifest))
        except BaseException:
            sess.close()
            raise
    try:
        cfg = sess.sampling.fill(DecodeConfig(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed))
        parts: list[str] = []
        final = None
        first_at = 0.0
        for chunk in sess.decode(cfg):
            if chunk.done:
                final = chunk
                break
            if not first_at and (chunk.text or chunk.thinking or chunk.tool_calls):
                first_at = time.perf_counter()
            parts.append(chunk.text)
            if not args.json and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    finally:
        sess.close()
    wall_ms = (time.perf_counter() - t0) * 1000
    ttft_ms = (first_at - t0) * 1000 if first_at else None
    if args.json:
        _print_json(
            {
                "text": "".join(parts),
                "finish_reason": final.finish_reason if final else "",
                "prefix": pre.model_dump(mode="json"),
                "suffix": suf.model_dump(mode="json"),
                "usage": final.usage.model_dump(mode="json") if final and final.usage else None,
                "ttft_ms": ttft_ms,
                "wall_ms": wall_ms,
            }
        )
    else:
        print()
        u = final.usage if final else None
        print(
            f"[prefix reused {pre.reused_tokens}/{pre.prefix_tokens}, prefilled {pre.prefilled_tokens}; "
            f"suffix {suf.suffix_tokens}; "
            + (f"{u.completion_tokens} tokens, {u.tokens_per_second:.1f} tok/s; " if u else "")
            + (f"time to first token {ttft_ms:.0f} ms]" if ttft_ms is not None else "no tokens]"),
            file=sys.stderr,
        )
    return 0


_COMMANDS: dict[str, Callable[[Client, argparse.Namespace], int]] = {
    "status": _status,
    "load": _load,
    "unload": _unload,
    "describe": _describe,
    "embed": _embed,
    "run": _run,
    "chat": run_chat,
    "cache": _cache,
    "why": _why,
    "metrics": _metrics,
    "takeover": _takeover,
    "cancel": _cancel,
}
