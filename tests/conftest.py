from __future__ import annotations

import os
import tempfile

# Tests must never talk to a daemon the developer is running.
os.environ.pop("MODELD_ENDPOINT", None)
os.environ.pop("MODELD_OWNER", None)
# nor read the developer's settings: every MODELD_* variable and the config file are theirs
for _name in [n for n in os.environ if n.startswith("MODELD_") and n != "MODELD_LLAMA_EXTRA_BUFTS"]:
    os.environ.pop(_name)
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="modeld-test-config-")
