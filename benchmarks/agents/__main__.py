"""``make agents`` (``python -m benchmarks.agents [options]``): the real coding agents against the daemon.

Installs the agents once at pinned versions into ``.cache/agents`` (npm packages in one prefix, a venv
per PyPI agent), starts ``modeld serve --backend auto --http 127.0.0.1:PORT`` on a free port with its
own endpoint and data dir, then runs each agent headless and offline (scratch HOME, telemetry and
update checks off) on its own scratch git repository with two small tasks, one run each ("Fix the bug
in calc.py …", then "Add a test …": a user's next request reuses what the first left warm), through a
recording proxy. Prints one row per agent: requests the daemon served (from its JSON access
log, matched to the agent by when each request started), errors (status >= 400 or an error code),
prefix reuse (cached ÷ prompt tokens over the requests after the first), prompt tokens, time, whether
the repository changed, whether ``add`` now returns the sum, and the agent's exit code.

Options: ``--only opencode,aider`` (a subset), ``--timeout 420`` (seconds per agent and task; more under ``--load``),
``--tasks N``, ``--load N`` (N CPU-bound processes beside the daemon),
``--task TEXT`` (repeatable: the tasks instead of the two), ``--model NAME``
(default: the first of ``/v1/models``), ``--context N``, ``--outdir DIR``, ``--backend``,
``--serve-arg ARG`` (``--serve-arg=--slow-prefix-s=340``: every agent's first prefill past 330 s, its later
turns at this machine's speed), ``--kill-within S`` (kill each agent at a random moment of its first S seconds, as
its own timeout would, and time how soon the slot is free; ``--seed N``), ``--settle S`` (wait after an agent for
its requests to end), ``--claude-tools LIST``
(Claude Code's ``--tools``; default ``Bash,Edit,Read,Write``, ``default`` for its own set), ``--install-only``,
``--reinstall``, ``--peer llama-server`` (then the same agents and tasks against llama.cpp's server on the file,
window and model name modeld served, and both tables side by side; its figures come from the proxy's records, its
time to first token is a stream's first event). With make: ``make agents AGENTS_ARGS="--only codex"``.

Output, in ``--outdir`` (default ``.cache/agents/runs/TIME``): ``<agent>.log`` (its stdout and stderr),
``<agent>/NNN-<route>.json`` (each request it sent and the response), ``daemon.log``, ``agents.json``
(everything), ``scratch/<agent>/{repo,home}`` (its repository and configs). The exit status is 0 even
when agents fail (this is a report); 2 when the agents could not be installed or the daemon did not start.

``python -m benchmarks.agents replay RUN``: a run's requests replayed against modeld, llama-server and
llama-cpp-python's server, one output token each (``benchmarks.agents.replay``).
"""

import sys

if sys.argv[1:2] == ["replay"]:  # python -m benchmarks.agents replay RUN (benchmarks.agents.replay)
    from benchmarks.agents.replay import main as replay

    sys.exit(replay(sys.argv[2:]))

from benchmarks.agents.runner import main

sys.exit(main())
