"""How each agent is configured and launched: headless, offline, pointed at the recording proxy.

Each agent gets a scratch HOME (and XDG dirs) so a user's own configs are never read or written,
and an environment built from scratch: no API keys or proxies of the user's leak in. Telemetry,
update checks, sharing and model-list fetches are switched off through each agent's own settings.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.agents.install import Installed
from benchmarks.agents.scratch import GIT_ENV

__all__ = ["AGENTS", "Context", "Launch", "base_env"]

#: what the agents send as their key (the daemon runs without --api-key; the proxy masks it in dumps)
API_KEY = "sk-modeld-agents"
#: environment variables passed through from the harness
KEEP_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "TZ", "USER", "LOGNAME", "SHELL", "TMPDIR")


@dataclass(frozen=True)
class Context:
    """What an agent's launch needs."""

    name: str
    installed: Installed
    server: str  # the proxy's root URL, e.g. http://127.0.0.1:PORT (no /v1)
    model: str
    context: int  # the model's context window, tokens
    output: int  # the most tokens an agent should ask for in one reply
    task: str
    repo: Path
    home: Path
    outdir: Path  # where the agent's own records (trajectories) go
    #: Claude Code's built-in tools (its ``--tools``): "default" is its own set of a dozen, whose
    #: schemas alone are ~10k tokens; a list keeps its first prompt inside a small model's window
    claude_tools: str = "default"

    @property
    def v1(self) -> str:
        return self.server + "/v1"


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path


def base_env(ctx: Context) -> dict[str, str]:
    """A fresh environment: scratch HOME and XDG dirs, the agents' bins first on PATH, no color, git identity."""
    home = ctx.home
    env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
    for sub in (".config", ".local/share", ".cache", ".local/state"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    # git reads its identity from HOME's config (aider asks for it otherwise)
    name, email = GIT_ENV["GIT_AUTHOR_NAME"], GIT_ENV["GIT_AUTHOR_EMAIL"]
    _write(home / ".gitconfig", f"[user]\n\tname = {name}\n\temail = {email}\n[init]\n\tdefaultBranch = main\n")
    path = os.pathsep.join([str(ctx.installed.npm_bin), os.environ.get("PATH", "/usr/bin:/bin")])
    env.update(
        HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
        XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"), PATH=path,
        TERM="dumb", NO_COLOR="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
        DO_NOT_TRACK="1", PYTHONUNBUFFERED="1", GIT_CONFIG_NOSYSTEM="1", **GIT_ENV,
    )
    return env


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def opencode(ctx: Context) -> Launch:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "modeld": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "modeld",
                "options": {"baseURL": ctx.v1, "apiKey": API_KEY},
                "models": {ctx.model: {"name": ctx.model, "tool_call": True,
                                       "limit": {"context": ctx.context, "output": ctx.output}}},
            }
        },
        "model": f"modeld/{ctx.model}",
        "small_model": f"modeld/{ctx.model}",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
    }
    config_dir = ctx.home / ".config" / "opencode"
    path = _write(config_dir / "opencode.json", json.dumps(config, indent=2) + "\n")
    # the plugin package it installs into each config dir, already there: no registry access at run time
    plugin = ctx.installed.opencode_config
    for name in ("package.json", "package-lock.json"):
        shutil.copyfile(plugin / name, config_dir / name)
    link = config_dir / "node_modules"
    if not link.is_symlink():  # the next task's launch finds it in place
        link.symlink_to(plugin / "node_modules", target_is_directory=True)
    env = base_env(ctx)
    env.update(OPENCODE_CONFIG=str(path), OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_SHARE="1",
               OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1")
    argv = [ctx.installed.exe("opencode"), "run", "--print-logs", "--log-level", "INFO",
            "-m", f"modeld/{ctx.model}", ctx.task]
    return Launch(argv, env, ctx.repo)


def codex(ctx: Context) -> Launch:
    codex_home = ctx.home / ".codex"
    toml = f"""model = "{ctx.model}"
model_provider = "modeld"
model_context_window = {ctx.context}
approval_policy = "never"
sandbox_mode = "workspace-write"
check_for_update_on_startup = false

[model_providers.modeld]
name = "modeld"
base_url = "{ctx.v1}"
env_key = "MODELD_AGENTS_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
log_user_prompt = false
"""
    _write(codex_home / "config.toml", toml)
    env = base_env(ctx)
    env.update(CODEX_HOME=str(codex_home), MODELD_AGENTS_KEY=API_KEY)
    argv = [ctx.installed.exe("codex"), "exec", "--strict-config", "--skip-git-repo-check", "--color", "never",
            "-s", "workspace-write", ctx.task]
    return Launch(argv, env, ctx.repo)


def claude(ctx: Context) -> Launch:
    # A finished onboarding and the key approved, so nothing asks (the key's last 20 characters are kept).
    state = {"hasCompletedOnboarding": True, "customApiKeyResponses": {"approved": [API_KEY[-20:]], "rejected": []},
             "autoUpdates": False}
    _write(ctx.home / ".claude.json", json.dumps(state, indent=2) + "\n")
    env = base_env(ctx)
    env.update(
        ANTHROPIC_BASE_URL=ctx.server, ANTHROPIC_API_KEY=API_KEY,
        # the background work (titles, summaries) goes to the same model: the daemon serves one
        ANTHROPIC_DEFAULT_HAIKU_MODEL=ctx.model, ANTHROPIC_SMALL_FAST_MODEL=ctx.model,
        # The reply limit, so max_tokens is not 32000. The window (CLAUDE_CODE_MAX_CONTEXT_TOKENS) is left
        # unset on purpose: told a window smaller than its first prompt, Claude Code refuses before sending
        # anything ("Prompt is too long"), and the point here is what the daemon answers.
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(ctx.output),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1", DISABLE_BUG_COMMAND="1",
        CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL="1", CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY="1",
    )
    argv = [ctx.installed.exe("claude"), "-p", ctx.task, "--model", ctx.model, "--permission-mode", "acceptEdits",
            "--tools", ctx.claude_tools]
    return Launch(argv, env, ctx.repo)


def qwen(ctx: Context) -> Launch:
    settings = {
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "security": {"auth": {"selectedType": "openai"}, "folderTrust": {"enabled": False}},
        "model": {"generationConfig": {"contextWindowSize": ctx.context}},
        "ui": {"hideTips": True},
        "agents": {"crossSessionMessaging": False},
    }
    _write(ctx.home / ".qwen" / "settings.json", json.dumps(settings, indent=2) + "\n")
    env = base_env(ctx)
    env.update(QWEN_CODE_DISABLE_PRECONNECT="1", QWEN_CODE_MAX_OUTPUT_TOKENS=str(ctx.output))
    argv = [ctx.installed.exe("qwen"), "--auth-type", "openai", "--openai-base-url", ctx.v1,
            "--openai-api-key", API_KEY, "-m", ctx.model, "--yolo", "--telemetry", "false", "-p", ctx.task]
    return Launch(argv, env, ctx.repo)


def aider(ctx: Context) -> Launch:
    # The model's metadata from a local file: aider then never fetches litellm's price list.
    meta = {f"openai/{ctx.model}": {"max_input_tokens": ctx.context, "max_output_tokens": ctx.output,
                                    "max_tokens": ctx.output, "input_cost_per_token": 0.0,
                                    "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}}
    meta_path = _write(ctx.home / "aider-model-metadata.json", json.dumps(meta, indent=2) + "\n")
    # aider sends no max_tokens of its own (its metadata is for its own accounting): the reply limit goes
    # in the request through the model's extra_params, as the other agents' settings send theirs
    settings = [{"name": f"openai/{ctx.model}", "extra_params": {"max_tokens": ctx.output}}]
    settings_path = _write(ctx.home / "aider-model-settings.yml", json.dumps(settings, indent=2) + "\n")  # JSON is YAML
    env = base_env(ctx)
    env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", AIDER_CHECK_UPDATE="false", AIDER_ANALYTICS="false")
    argv = [ctx.installed.exe("aider"), "--openai-api-base", ctx.v1, "--openai-api-key", API_KEY,
            "--model", f"openai/{ctx.model}", "--model-metadata-file", str(meta_path),
            "--model-settings-file", str(settings_path),
            "--message", ctx.task, "--yes-always", "--no-check-update", "--analytics-disable", "--no-gitignore",
            "--no-show-model-warnings", "--no-show-release-notes", "--no-detect-urls", "--disable-playwright",
            "--no-pretty", "--no-fancy-input", "--env-file", str(ctx.home / ".env"),
            # the files the session's tasks work on, in the chat from its start as aider's users add them: a
            # file aider adds when a task names it changes its repository map ahead of the new message
            "calc.py", "test_calc.py"]
    return Launch(argv, env, ctx.repo)


def mini(ctx: Context) -> Launch:
    overrides = {
        "agent": {"step_limit": 5, "cost_limit": 0},
        "model": {"cost_tracking": "ignore_errors",
                  "model_kwargs": {"api_base": ctx.v1, "api_key": API_KEY, "max_tokens": ctx.output}},
        "environment": {"cwd": str(ctx.repo), "timeout": 60},
    }
    cfg = _write(ctx.home / "mini-overrides.yaml", json.dumps(overrides, indent=2) + "\n")  # JSON is YAML
    env = base_env(ctx)
    env.update(MSWEA_CONFIGURED="true", MSWEA_SILENT_STARTUP="1", MSWEA_COST_TRACKING="ignore_errors",
               MSWEA_GLOBAL_CONFIG_DIR=str(ctx.home / ".config" / "mini-swe-agent"),
               LITELLM_LOCAL_MODEL_COST_MAP="True")
    argv = [ctx.installed.exe("mini"), "-m", f"openai/{ctx.model}", "-t", ctx.task, "--yolo", "--exit-immediately",
            "-o", str(ctx.outdir / "mini.traj.json"), "-c", "mini.yaml", "-c", str(cfg)]
    return Launch(argv, env, ctx.repo)


#: the tool ``llm`` is given (Python source, ``--functions``)
LLM_TOOL = "def add(a: int, b: int) -> int:\n    \"\"\"Add two integers.\"\"\"\n    return a + b\n"


def llm(ctx: Context) -> Launch:
    user = ctx.home / "llm"
    models = (f"- model_id: modeld\n  model_name: {json.dumps(ctx.model)}\n  api_base: {json.dumps(ctx.v1)}\n"
              "  api_key_name: modeld\n  supports_tools: true\n  can_stream: true\n")
    _write(user / "extra-openai-models.yaml", models)
    env = base_env(ctx)
    env.update(LLM_USER_PATH=str(user))
    argv = [ctx.installed.exe("llm"), "prompt", "-m", "modeld", "--key", API_KEY, "--functions", LLM_TOOL,
            "--td", "--cl", "3", "-o", "max_tokens", str(ctx.output), "What is 2+3? Use the add tool."]
    return Launch(argv, env, ctx.repo)


AGENTS: dict[str, Callable[[Context], Launch]] = {
    "opencode": opencode,
    "codex": codex,
    "claude": claude,
    "qwen": qwen,
    "aider": aider,
    "mini": mini,
    "llm": llm,
}
