"""The CLI as a person meets it: progress bars, shell completion, and what status says about the daemon.

Every test drives the real ``modeld`` console script (or the real client)
against a real daemon process. A progress bar needs an operation that runs for
seconds: a cold prefill of a long prompt on the bundled model (llama.cpp, in
small batches so it reports often). Cheap cases use the memory backend.
A terminal is a pseudo-terminal (``os.openpty``) on the CLI's stderr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract import wire
from contract.types import (
    Config,
    Heartbeat,
    LoadModelRequest,
    OpenSessionRequest,
    PrefixInput,
    Progress,
    SpeculationStatus,
)
from contract.wire import Kind
from harness.daemon import ROOT, DaemonProcess, wait_until
from runtime.cli import _speculation_rows
from runtime.progress import ProgressDisplay

MODELD = str(Path(sys.executable).parent / "modeld")
#: the CLI with rich hidden: what a client install without the `cli` extra runs
MODELD_WITHOUT_RICH = [sys.executable, "-c", "import sys; sys.modules['rich'] = None; "
                       "from modeld.cli import main; sys.exit(main())"]
CLI_TIMEOUT_S = 400


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": "120"}
    env.pop("MODELD_ENDPOINT", None)
    return env


def run_cli(args: list[str], *, tty: bool, command: list[str] | None = None, stdin: str = "") -> tuple[int, str, str]:
    """Run the CLI with ``stdin``; its stderr is a pseudo-terminal when ``tty``, else a pipe. Returns (code, stdout, stderr)."""
    cmd = [*(command or [MODELD]), *args]
    if not tty:
        out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=CLI_TIMEOUT_S,
                             input=stdin)
        return out.returncode, out.stdout, out.stderr
    master, slave = os.openpty()
    received = bytearray()

    def drain() -> None:  # a terminal that is not read blocks its writer
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            received.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=slave, env=_env(),
                                cwd=ROOT, text=True)
        os.close(slave)
        stdout, _ = proc.communicate(input=stdin, timeout=CLI_TIMEOUT_S)
        reader.join(timeout=10)
    finally:
        os.close(master)
    return proc.returncode, stdout, received.decode(errors="replace")


# --- shell completion --------------------------------------------------------------------------
def _complete(script: Path, words: list[str]) -> list[str]:
    """What bash offers for ``words`` (the last one is being typed), through the generated function."""
    quoted = " ".join(f"'{w}'" for w in words)
    probe = (f'source {script}; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; '
             f'COMP_LINE="{" ".join(words)}"; COMP_POINT=${{#COMP_LINE}}; _shtab_modeld; printf "%s\\n" "${{COMPREPLY[@]}}"')
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_completion_bash_is_a_script_bash_accepts_that_completes_commands_and_their_flags(tmp_path: Path) -> None:
    code, script, err = run_cli(["completion", "bash"], tty=False)
    assert code == 0, err
    assert "serve" in script and "--backend" in script
    path = tmp_path / "modeld.bash"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    assert {"serve", "status", "chat", "completion"} <= set(_complete(path, ["modeld", ""]))
    assert _complete(path, ["modeld", "serve", "--back"]) == ["--backend"]  # serve's own parser
    assert set(_complete(path, ["modeld", "serve", "--backend", ""])) == {"auto", "llama", "openvino", "vllm", "memory"}
    assert "--max-tokens" in _complete(path, ["modeld", "run", "--max"])  # a client command's option
    assert _complete(path, ["modeld", "prepare", "--on"]) == ["--only"]
    # the store's commands, by their own parsers
    assert _complete(path, ["modeld", "pull", "--rep"]) == ["--replace"]
    assert _complete(path, ["modeld", "rm", "--fo"]) == ["--force"]
    assert "--endpoint" in _complete(path, ["modeld", "ls", "--"])
    assert _complete(path, ["modeld", "keys", "--da"]) == ["--data-dir"]
    assert "--api-key" in _complete(path, ["modeld", "http", "--api"])


def test_completion_zsh_and_an_unknown_shell() -> None:
    code, script, err = run_cli(["completion", "zsh"], tty=False)
    assert code == 0, err
    assert script.startswith("#compdef modeld") and "--backend" in script
    if shutil.which("zsh"):
        check = subprocess.run(["zsh", "-n"], input=script, capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
    code, _, err = run_cli(["completion", "fish"], tty=False)
    assert code == 2 and "invalid choice: 'fish'" in err


def test_completion_without_shtab_says_how_to_install_it() -> None:
    command = [sys.executable, "-c", "import sys; sys.modules['shtab'] = None; from modeld.cli import main; sys.exit(main())"]
    code, out, err = run_cli(["completion", "bash"], tty=False, command=command)
    assert code == 1 and out == ""
    assert "shtab" in err and "pip install 'modeld[cli]'" in err


def test_the_client_alone_completes_its_own_commands_and_cannot_pull(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``runtime.cli`` without the daemon's extensions (a client-only install): completion knows the client
    commands but not ``serve``'s options, and ``load --pull`` says which install pulls, before any request."""
    pytest.importorskip("shtab")
    from modeld.cli import daemon_parsers
    from runtime.cli import Extensions, completion_script, main

    alone = completion_script("bash")
    whole = completion_script("bash", Extensions(parsers=daemon_parsers))
    assert "status" in alone and "--num-ctx" in whole and "--cache-ram" in whole and "--cache-ram" not in alone
    code = main(["load", "acme/Tiny-GGUF:Q8_0", "--pull", "--endpoint", f"ipc://{tmp_path / 'none.sock'}"])
    assert code == 1 and "the daemon's install" in capsys.readouterr().err


# --- status -------------------------------------------------------------------------------------------
def _rows(table: str) -> dict[str, str]:
    """The rows of an aligned two-column table (names may hold spaces; the value column starts where the first
    row's value does)."""
    lines = table.splitlines()
    first = lines[0]
    name_end = first.index("  ")
    col = name_end + len(first[name_end:]) - len(first[name_end:].lstrip())
    return {line[:col].strip(): line[col:] for line in lines}


@pytest.fixture(scope="module")
def memory_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("ux-memory"), "memory") as d:
        yield d


def test_status_shows_the_daemon_pid_and_uptime(memory_daemon: DaemonProcess) -> None:
    assert memory_daemon.proc is not None
    with memory_daemon.client(timeout_s=30.0) as c:  # an uptime of at least a second, whatever else ran first
        wait_until(lambda: c.status().uptime_s >= 1.0, "up a second")
    code, out, err = run_cli(["status", "--endpoint", memory_daemon.endpoint], tty=False)
    assert code == 0, err
    rows = _rows(out)
    assert rows["pid"] == str(memory_daemon.proc.pid)
    assert rows["uptime"].endswith("s") and int(rows["uptime"].split()[-1].rstrip("s")) >= 1
    assert "speculation" not in rows  # the reference model computes no logits to check a draft with
    code, out, err = run_cli(["status", "--json", "--endpoint", memory_daemon.endpoint], tty=False)
    assert code == 0, err
    st = json.loads(out)
    assert st["pid"] == memory_daemon.proc.pid and st["uptime_s"] >= 1.0


def test_load_with_json_prints_only_json(memory_daemon: DaemonProcess) -> None:
    code, out, err = run_cli(["load", "m", "--type", "memory", "--path", "/models/m", "--json",
                              "--endpoint", memory_daemon.endpoint], tty=True)
    assert code == 0, err
    assert json.loads(out)["model_name"] == "m"
    assert err == ""


def test_load_passes_the_attention_kernel_and_kv_cache_type(memory_daemon: DaemonProcess) -> None:
    code, out, err = run_cli(["load", "m", "--type", "memory", "--path", "/models/m", "--flash-attn",
                              "--kv-cache-type", "q8_0", "--exact-decode", "--json",
                              "--endpoint", memory_daemon.endpoint], tty=False)
    assert code == 0, err
    config = json.loads(out)["config"]
    assert (config["flash_attn"], config["kv_cache_type"], config["exact_decode"]) == (True, "q8_0", True)
    code, out, err = run_cli(["status", "--endpoint", memory_daemon.endpoint], tty=False)
    assert code == 0, err
    assert "flash attention, KV cache q8_0, exact decode" in out
    code, _, err = run_cli(["load", "m", "--type", "memory", "--path", "/models/m", "--kv-cache-type", "q5_1",
                            "--endpoint", memory_daemon.endpoint], tty=False)
    assert code == 2 and "invalid choice: 'q5_1'" in err
    code, _, err = run_cli(["load", "m", "--type", "memory", "--path", "/models/m", "--option", "greeting=hi",
                            "--endpoint", memory_daemon.endpoint], tty=False)
    assert code == 1 and "refused by the memory reference backend: it takes none (given: greeting)" in err, err


# --- the heartbeat's progress on the wire -------------------------------------------------------------
def test_an_empty_heartbeat_stays_valid_and_a_bad_progress_is_ignored() -> None:
    empty = wire.decode_reply(wire.encode_reply(Kind.HEARTBEAT, b"r"))
    assert empty.body == {} and wire.heartbeat_progress(empty) is None
    p = Progress(stage="prefill", done=3, total=8, fraction=0.375)
    full = wire.decode_reply(wire.encode_reply(Kind.HEARTBEAT, b"r", Heartbeat(progress=p)))
    assert wire.heartbeat_progress(full) == p
    bad = wire.Message(request_id=b"r", body={"progress": {"fraction": 7}}, kind=Kind.HEARTBEAT)
    assert wire.heartbeat_progress(bad) is None


# --- the display's rules, with a terminal stand-in and a clock --------------------------------------------
class _Terminal:
    def __init__(self, tty: bool = True) -> None:
        self.text = ""
        self.tty = tty

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty


def test_the_display_waits_out_its_delay_and_draws_only_on_a_terminal() -> None:
    now = [0.0]
    p = Progress(stage="prefill", done=512, total=2048, fraction=0.25)
    term = _Terminal()
    with ProgressDisplay(stream=term, clock=lambda: now[0], use_rich=False) as display:  # type: ignore[arg-type]
        now[0] = 1.9
        display(p)
        assert term.text == ""  # a warm turn is over before this: nothing flickers
        now[0] = 2.1
        display(p)
        assert term.text == "modeld: prefill 25% (512/2048 tokens)\n"
    display(p)  # closed: nothing more
    assert term.text.count("\n") == 1
    pipe = _Terminal(tty=False)
    with ProgressDisplay(stream=pipe, clock=lambda: now[0] + 10, use_rich=False) as display:  # type: ignore[arg-type]
        now[0] = 100.0
        display(p)
    assert pipe.text == ""
    off = _Terminal()
    with ProgressDisplay(enabled=False, stream=off, clock=lambda: now[0], use_rich=False) as display:  # type: ignore[arg-type]
        now[0] = 200.0
        display(p)
    assert off.text == ""


# --- a cold prefill on the bundled model ------------------------------------------------------------
NUM_CTX = 4096
#: small batches: llama.cpp reports progress per batch
NUM_BATCH = 64
#: a cold prefill's prompt: about ``TOKENS_PER_ITEM * ITEMS`` tokens, ~10 batches
TOKENS_PER_ITEM = 20
ITEMS = 30
MIN_PREFILL = ITEMS * TOKENS_PER_ITEM * 3 // 4
#: each batch of a prefill held back this long (the daemon's ``--prefill-chunk-delay-ms``): a cold prefill lasts
#: ~6 s on any machine, long enough for a bar (shown from 2 s) and several heartbeats, where a prompt sized to a
#: rate measured at the start would hang the tests on how busy the machine was then
CHUNK_DELAY_MS = 600
#: what the bar (and the plain lines) show of a prefill, and nothing else prints
BAR = re.compile(r"\d+/\d+ tokens")


def _long_system(tag: str, items: int) -> str:
    """About ``TOKENS_PER_ITEM * items`` tokens, starting with ``tag`` so that no two tests share a resident prefix."""
    return f"{tag}. " + " ".join(f"Rule {i}: the {tag} value of item {i} is {i * 7}." for i in range(items))


@pytest.fixture(scope="module")
def llama_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    from backends.bundled import bundled_gguf_path

    d = DaemonProcess(tmp_path_factory.mktemp("ux-llama"), "llama", None, "--cache-ram", "0", "--cache-disk", "0",
                      "--prefill-chunk-delay-ms", str(CHUNK_DELAY_MS))
    with d.start(ready_timeout_s=300, wait_state=("Ready",)):
        with d.client(timeout_s=300) as c:
            c.load_model(LoadModelRequest(model_name="smol", path=str(bundled_gguf_path()),
                                          config=Config(num_ctx=NUM_CTX, num_batch=NUM_BATCH)))
        yield d


@pytest.mark.llama
def test_describe_lists_the_engine_s_options_and_load_refuses_one_it_does_not_take(llama_daemon: DaemonProcess) -> None:
    code, out, err = run_cli(["describe", "--endpoint", llama_daemon.endpoint], tty=False)
    assert code == 0, err
    assert _rows(out)["option extra_bufts"].startswith("boolean, default unset: the CPU's repacked forms of the weights")
    with llama_daemon.client() as c:
        before = c.status()
    from backends.bundled import bundled_gguf_path

    code, out, err = run_cli(["load", "smol", "--path", str(bundled_gguf_path()), "--num-ctx", str(NUM_CTX),
                              "--option", "inference_precision=f32", "--endpoint", llama_daemon.endpoint], tty=False)
    assert code == 1 and ("InvalidArgument: engine option refused by llama.cpp: inference_precision: not an option "
                          "it takes (its options: extra_bufts, mmproj)") in err, err
    with llama_daemon.client() as c:  # refused before anything was released: the same model, still serving
        after = c.status()
    assert (after.state.value, after.generation, after.active.model_name if after.active else "") == (
        "Ready", before.generation, "smol")


@pytest.mark.llama
@pytest.mark.slow
def test_serve_logs_the_preload_progress(llama_daemon: DaemonProcess) -> None:
    log = llama_daemon.log()
    preload = log[: log.index("preloaded the model")]  # (the fixture's own load follows it)
    lines = [line for line in preload.splitlines() if "loading the model:" in line]
    assert lines, log
    shares = [int(line.rsplit(" ", 1)[-1].rstrip("%")) for line in lines]
    assert shares == sorted(shares) and shares[-1] == 100 and all(s % 10 == 0 for s in shares)
    assert " INFO " in lines[0]


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_status_of_a_llama_daemon_lists_the_embedding_slot(llama_daemon: DaemonProcess) -> None:
    code, out, err = run_cli(["status", "--endpoint", llama_daemon.endpoint], tty=False)
    assert code == 0, err
    rows = _rows(out)
    assert rows["embedding"].startswith("not loaded (llama")
    assert "inputs embedded" in out
    assert rows["speculation"].startswith("on for greedy decodes; a check of 2 / 4 / 8 / 16 rows costs ")
    # which of these depends on whether the daemon was idle long enough to time the checks (test_status_says_how_
    # the_model_drafts has each)
    assert rows["speculation"].endswith((", measured on this machine", ", a prior until timed (when the slot is idle)",
                                         ", a prior (not measured)"))
    assert rows["drafts"] == "none drafted yet" or " drafted tokens kept (" in rows["drafts"]


def test_status_says_how_the_model_drafts() -> None:
    on = SpeculationStatus(enabled=True, measured=True, check_costs={"2": 1.81, "4": 2.72, "8": 4.58, "16": 8.23},
                           check_growth_per_1k=1.35, drafted_tokens=266, accepted_tokens=236)
    assert _speculation_rows(on) == [
        ("speculation", "on for greedy decodes; a check of 2 / 4 / 8 / 16 rows costs 1.81 / 2.72 / 4.58 / 8.23 "
                        "one-token steps (16 rows: +1.35 per 1,000 tokens of context), measured on this machine"),
        ("drafts", "236 of 266 drafted tokens kept (89%)"),
    ]
    off = SpeculationStatus(check_costs={"2": 1.25, "16": 4.75})
    assert _speculation_rows(off) == [
        ("speculation", "off unless a request asks; a check of 2 / 16 rows costs 1.25 / 4.75 one-token steps, "
                        "a prior (not measured)"),
        ("drafts", "none drafted yet"),
    ]
    pending = SpeculationStatus(enabled=True, pending=True, check_costs={"2": 1.25})
    assert _speculation_rows(pending)[0][1].endswith("costs 1.25 one-token steps, a prior until timed (when the slot is idle)")
    probed = "probed at load: 4 one-token steps, a 16-row check and a 32-token prefill, their rows equal bit for bit"
    exact = SpeculationStatus(enabled=True, rows_exact=True, rows_probe=probed)
    assert _speculation_rows(exact)[0][1].startswith("on for greedy and sampled decodes")
    assert _speculation_rows(exact)[2] == ("exact rows", f"yes: {probed}")
    apart = SpeculationStatus(enabled=True, rows_probe="probed at load: ... rows apart by up to 3.57 in the logits")
    assert _speculation_rows(apart)[0][1].startswith("on for greedy decodes")
    assert _speculation_rows(apart)[2] == ("exact rows", "no: probed at load: ... rows apart by up to 3.57 in the logits")
    assert _speculation_rows(SpeculationStatus(enabled=True, rows_exact=True))[2] == ("exact rows", "yes")


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cold_prefill_reports_growing_progress_to_the_caller_and_nobody_else(llama_daemon: DaemonProcess) -> None:
    seen: list[tuple[float, Progress]] = []
    waiting: list[Progress] = []
    with llama_daemon.client(timeout_s=300) as c, llama_daemon.client(timeout_s=300, on_progress=waiting.append) as other:
        sess = c.open_session(OpenSessionRequest())
        # another client waits for the slot meanwhile: its heartbeats carry no progress
        opened: list[object] = []
        waiter = threading.Thread(target=lambda: opened.append(other.open_session(OpenSessionRequest(queue_timeout_s=600))))
        waiter.start()
        t0 = time.monotonic()
        st = sess.ensure_prefix(PrefixInput(text=_long_system("callback", ITEMS), manifest=sess.manifest()),
                                on_progress=lambda p: seen.append((time.monotonic() - t0, p)))
        sess.close()
        waiter.join(timeout=300)
        assert opened, "the waiting open never got the slot"
    assert st.prefilled_tokens > MIN_PREFILL
    dones = [p.done for _, p in seen]
    assert len(set(dones)) >= 2, seen  # it moved while the client waited
    assert dones == sorted(dones) and dones[-1] <= st.prefilled_tokens
    for _, p in seen:
        assert p.stage == "prefill" and p.total == st.prefilled_tokens
        assert p.fraction == pytest.approx(p.done / p.total)
    assert waiting == []


def _run_turn(d: DaemonProcess, tag: str, *extra: str, tty: bool,
              command: list[str] | None = None) -> tuple[int, str, str]:
    system = d.tmp / f"{tag}.txt"
    system.write_text(_long_system(tag, ITEMS))
    return run_cli(["run", "Say hi.", "--system-file", str(system), "--max-tokens", "1", "--endpoint", d.endpoint,
                    *extra], tty=tty, command=command)


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_cold_prefill_on_a_terminal_shows_a_bar_and_a_warm_turn_does_not(llama_daemon: DaemonProcess) -> None:
    code, out, err = _run_turn(llama_daemon, "terminal", tty=True)
    assert code == 0, err
    assert "prefill" in err and BAR.search(err) and "%" in err, err
    assert "\x1b[" in err  # drawn (and erased) in place, not printed as lines
    assert "[prefix reused" in err  # the turn's summary follows the bar
    code, out, err = _run_turn(llama_daemon, "terminal", tty=True)  # the same prompt again: warm
    assert code == 0, err
    assert not BAR.search(err), err


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_no_bar_with_json_on_a_terminal_nor_on_a_pipe(llama_daemon: DaemonProcess) -> None:
    code, out, err = _run_turn(llama_daemon, "json", "--json", tty=True)
    assert code == 0, err
    assert err == ""
    assert json.loads(out)["prefix"]["prefilled_tokens"] > MIN_PREFILL
    code, out, err = _run_turn(llama_daemon, "pipe", tty=False)
    assert code == 0, err
    assert not BAR.search(err) and "%" not in err, err
    assert "[prefix reused" in err


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_without_rich_a_terminal_gets_plain_progress_lines(llama_daemon: DaemonProcess) -> None:
    code, out, err = _run_turn(llama_daemon, "plain", tty=True, command=MODELD_WITHOUT_RICH)
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("modeld: prefill ")]
    assert lines, err
    assert "tokens)" in lines[0] and "\x1b[" not in "".join(lines)



@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chat_shows_the_bar_until_the_reply_starts(llama_daemon: DaemonProcess) -> None:
    session = f"/system {_long_system('chat', ITEMS)}\nSay hi.\n/bye\n"
    code, out, err = run_cli(["chat", "--max-tokens", "8", "--endpoint", llama_daemon.endpoint], tty=True, stdin=session)
    assert code == 0, err
    assert "prefill" in err and BAR.search(err), err
    assert err.index("prefill") < err.index("[reused")  # the bar comes first, the turn's summary after it
    assert out.strip() != ""  # the reply went to stdout, past the bar
