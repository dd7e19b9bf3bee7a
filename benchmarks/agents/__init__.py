"""``make agents``: the real coding agents (OpenCode, Codex, Claude Code, Qwen Code, aider, mini-swe-agent, llm)
run headless and offline against a private daemon, each request recorded; see ``__main__``."""
