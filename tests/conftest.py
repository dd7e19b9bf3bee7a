from __future__ import annotations

import os

# Tests must never talk to a daemon the developer is running.
os.environ.pop("MODELD_ENDPOINT", None)
os.environ.pop("MODELD_OWNER", None)
