"""``modeld pull | ls | show | rm | alias``: the model store from the command line.

They work on the store directly (``--data-dir``, else the daemon's data dir as ``modeld serve`` resolves
it: ``$MODELD_DATA_DIR``, else the config file's ``data_dir``, else the platform's), so they run with or without a daemon. ``ls`` and ``rm`` ask a running
daemon what it has loaded (``--endpoint``); ``rm`` refuses to delete the loaded model unless
``--force``, which unloads it first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.registry import model_format
from runtime.cli import size_text  # the client commands' sizes, as `modeld status` prints them

from ..settings import SettingsError
from .pull import PullError, pull
from .refs import RefError
from .store import ModelStore, StoredModel, StoreError, default_store_dir

__all__ = ["COMMANDS", "build_parser", "command_parsers", "main", "model_facts", "pull_into_store"]

EXIT_ERROR = 1
#: the settings (the config file naming the data dir) did not load
EXIT_USAGE = 2
#: how long ``ls``/``rm`` wait for a running daemon's status
STATUS_TIMEOUT_S = 5.0


def _common(p: argparse.ArgumentParser, *, endpoint: bool = False) -> None:
    p.add_argument("--data-dir", type=Path, default=None,
                   help="the daemon's data dir; the store is its models/ (default: as `modeld serve` resolves it: "
                   "$MODELD_DATA_DIR, else the config file's data_dir, else the platform's)")
    p.add_argument("--json", action="store_true", help="print JSON")
    if endpoint:
        p.add_argument("--endpoint", default=None, help="the daemon to ask what is loaded (default: as the client's)")


def _pull_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("ref", help="user/repo:QUANT (e.g. Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:Q4_K_M), "
                   "user/repo/FILE.gguf, or a local GGUF / OpenVINO IR directory")
    s.add_argument("--name", default="", help="the name to keep it under (default: repo:quant in lower case)")
    s.add_argument("--replace", action="store_true", help="replace a stored model of the same name")
    _common(s)


def _show_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("name")
    _common(s)


def _rm_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("name")
    s.add_argument("--force", action="store_true", help="unload it first when it is the loaded model")
    _common(s, endpoint=True)


def _alias_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("alias", nargs="?", default="")
    s.add_argument("target", nargs="?", default="")
    s.add_argument("--rm", action="store_true", help="remove the alias")
    _common(s)


#: each command's help and the function that adds its arguments
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "pull": ("download a model into the store: user/repo:QUANT, user/repo/FILE.gguf or a path", _pull_args),
    "ls": ("list the stored models", lambda s: _common(s, endpoint=True)),
    "show": ("one stored model: its source, files, checksums, what a load would see", _show_args),
    "rm": ("delete a stored model (refused while it is loaded, unless --force)", _rm_args),
    "alias": ("NAME TARGET: another name for a stored model; --rm NAME drops one; none: list them", _alias_args),
}
COMMANDS = tuple(_COMMANDS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modeld", description="The local model store.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (what, add_args) in _COMMANDS.items():
        add_args(sub.add_parser(name, help=what))
    return p


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's arguments on a parser of its own (no help option), for the completion script."""
    out = {}
    for name, (_what, add_args) in _COMMANDS.items():
        out[name] = argparse.ArgumentParser(prog=f"modeld {name}", add_help=False)
        add_args(out[name])
    return out


def model_facts(model: StoredModel, directory: Path) -> dict[str, Any]:
    """What a load would see of a stored model: its architecture, trained context and layers (its format's header),
    and the engine ``modeld serve --backend auto`` would pick for it, with the reason."""
    path = model.path_in(directory)
    out: dict[str, Any] = {"path": str(path)}
    fmt = model_format(model.format)
    if fmt is not None:
        try:
            out.update(fmt.facts(path))
        except (ImportError, OSError, ValueError) as exc:
            out["header_error"] = str(exc)
    try:
        from ..bootstrap import engine_facts
        from ..engine_choice import choose_backend

        out["engine"], out["engine_reason"] = choose_backend(engine_facts(str(path)))
    except (ImportError, OSError, ValueError) as exc:  # no engine installed: say so, list anyway
        out["engine"], out["engine_reason"] = "", str(exc)
    return out


def _loaded_path(endpoint: str | None) -> tuple[str | None, Any]:
    """The loaded model's path on a running daemon, and a client to it; (None, None) with no daemon."""
    from contract.endpoint import default_endpoint, ipc_path
    from runtime import Client

    ep = endpoint or default_endpoint()
    sock = ipc_path(ep)
    if sock is not None and not sock.exists():
        return None, None
    client = Client(ep, timeout_s=STATUS_TIMEOUT_S)
    try:
        st = client.status()
    except Exception:  # noqa: BLE001 - no daemon answering is a normal state for a store command
        client.close()
        return None, None
    return (st.active.path if st.active is not None else ""), client


def _is_loaded(loaded: str | None, model: StoredModel, directory: Path) -> bool:
    if not loaded:
        return False
    lp = os.path.realpath(loaded)
    return lp == os.path.realpath(model.path_in(directory)) or lp.startswith(os.path.realpath(directory) + os.sep)


def _pull(store: ModelStore, args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    m = pull(store, args.ref, name=args.name, replace=args.replace, log=log)
    if args.json:
        print(m.model_dump_json(indent=2))
    else:
        print(f"{m.name}  {size_text(m.size)}  {m.quant or m.format}  ({m.source})")
    return 0


def _ls(store: ModelStore, args: argparse.Namespace) -> int:
    loaded, client = _loaded_path(args.endpoint)
    if client is not None:
        client.close()
    rows = []
    for m in store.models():
        _, d = store.get(m.name)
        f = model_facts(m, d)
        rows.append({"name": m.name, "size": m.size, "quant": m.quant or m.format, "context": f.get("context", 0),
                     "engine": f.get("engine", ""), "loaded": _is_loaded(loaded, m, d), "source": m.source,
                     "capabilities": f.get("capabilities", [])})
    aliases = store.aliases()
    if args.json:
        print(json.dumps({"store": str(store.root), "models": rows, "aliases": aliases,
                          "daemon": loaded is not None}, indent=2))
        return 0
    if not rows:
        print(f"(no models in {store.root}: modeld pull user/repo:QUANT)")
    else:
        print(f"{'NAME':40}  {'SIZE':>9}  {'QUANT':8}  {'CONTEXT':>7}  {'ENGINE':8}  {'LOADED':6}  CAPABILITIES")
        for r in rows:
            mark = "yes" if r["loaded"] else ("-" if loaded is None else "")
            caps = ",".join(r["capabilities"]) or "-"
            print(f"{r['name']:40}  {size_text(r['size']):>9}  {r['quant']:8}  {r['context']:>7}  {r['engine']:8}  "
                  f"{mark:6}  {caps}")
        n, total = store.disk_usage()
        print(f"{n} model{'s' if n != 1 else ''}, {size_text(total)} in {store.root}"
              + ("" if loaded is not None else "; no daemon answered, so LOADED is unknown"))
    for a, t in sorted(aliases.items()):
        print(f"alias {a} -> {t}")
    return 0


def _show(store: ModelStore, args: argparse.Namespace) -> int:
    m, d = store.get(args.name)
    facts = model_facts(m, d)
    aliases = sorted(a for a, t in store.aliases().items() if t == m.name)
    if args.json:
        print(json.dumps({**m.model_dump(mode="json"), **facts, "aliases": aliases, "directory": str(d)}, indent=2))
        return 0
    rows: list[tuple[str, Any]] = [("name", m.name), ("source", m.source), ("revision", m.revision or "-"),
                                   ("format", m.format), ("quant", m.quant or "-"), ("size", size_text(m.size)),
                                   ("license", m.license or "-"), ("architecture", facts.get("architecture", "-")),
                                   ("context", facts.get("context", "-")), ("layers", facts.get("layers", "-")),
                                   ("engine", f"{facts.get('engine', '')} ({facts.get('engine_reason', '')})"),
                                   ("capabilities", ", ".join(facts.get("capabilities", [])) or "-"),
                                   ("path", facts["path"]), ("aliases", ", ".join(aliases) or "-")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    for f in m.files:
        print(f"  {f.name}  {size_text(f.size)}  sha256:{f.sha256}")
    return 0


def _rm(store: ModelStore, args: argparse.Namespace) -> int:
    m, d = store.get(args.name)
    loaded, client = _loaded_path(args.endpoint)
    try:
        if _is_loaded(loaded, m, d):
            if not args.force:
                print(f"modeld rm: {m.name} is the daemon's loaded model; `modeld unload` first, or --force "
                      "(which unloads it)", file=sys.stderr)
                return EXIT_ERROR
            from contract.types import UnloadModelRequest

            st = client.status()
            client.unload_model(UnloadModelRequest(expected_generation=st.generation))
            print(f"modeld rm: unloaded {m.name} (generation {st.generation})", file=sys.stderr)
    finally:
        if client is not None:
            client.close()
    store.remove(m.name)
    print(f"removed {m.name} ({size_text(m.size)})")
    return 0


def _alias(store: ModelStore, args: argparse.Namespace) -> int:
    if args.rm:
        if not args.alias:
            raise StoreError("modeld alias --rm NAME: name the alias")
        store.remove_alias(args.alias)
        return 0
    if not args.alias:
        aliases = store.aliases()
        if args.json:
            print(json.dumps(aliases, indent=2))
        for a, t in sorted(aliases.items()):
            print(f"{a} -> {t}")
        return 0
    if not args.target:
        raise StoreError("modeld alias NAME TARGET: name the stored model the alias leads to")
    print(f"{args.alias.lower()} -> {store.set_alias(args.alias, args.target)}")
    return 0


_RUN = {"pull": _pull, "ls": _ls, "show": _show, "rm": _rm, "alias": _alias}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        store = ModelStore(default_store_dir(args.data_dir))
    except SettingsError as exc:
        print(f"modeld {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _RUN[args.command](store, args)
    except (PullError, RefError, StoreError) as exc:
        if args.json:
            print(json.dumps({"error": {"type": type(exc).__name__, "message": str(exc)}}))
        print(f"modeld {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"modeld {args.command}: interrupted (a pull resumes where it stopped)", file=sys.stderr)
        return 130


def pull_into_store(ref: str, data_dir: Path | None = None) -> str:
    """``modeld load REF --pull``: REF's stored name, pulled first when the store lacks it (progress on stderr)."""
    store = ModelStore(default_store_dir(data_dir))
    found = store.find(ref)
    if found is not None:
        return found[0].name
    return pull(store, ref, log=lambda line: print(line, file=sys.stderr, flush=True)).name
