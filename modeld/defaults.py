"""The daemon's and the front's built-in defaults, in a leaf module: ``modeld.settings`` declares every setting
with these, and the components that read a setting default to the same value, without the settings model
importing them (ZeroMQ, the slot, the workers, uvicorn) to learn it.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_BLOB_BYTES",
    "DEFAULT_EMBED_IDLE_S",
    "DEFAULT_ENGINE_NICE",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_FETCH_REDIRECTS",
    "IMAGE_FETCH_TIMEOUT_S",
    "DEFAULT_LEASE_S",
    "DEFAULT_LISTEN",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_SESSION_TTL_S",
    "DEFAULT_STREAM_INTERVAL_S",
    "DEFAULT_WEDGE_S",
    "DEFAULT_WS_PAUSE_LIMIT_S",
    "EXIT_WEDGED",
    "MAX_NICE",
    "QUEUE_TIMEOUT_S",
    "STREAM_GRACE_S",
]

# --- the slot ---------------------------------------------------------------------------------------------------
#: seconds a client that stops renewing keeps its session
DEFAULT_LEASE_S = 30.0
#: a session whose client keeps renewing its lease but sends no operation is released after this
#: (seed 000's idle TTL); any operation, ``explain`` included, refreshes it
DEFAULT_SESSION_TTL_S = 1800.0

#: seconds before an idle embedding model is unloaded
DEFAULT_EMBED_IDLE_S = 300.0

# --- the model workers ------------------------------------------------------------------------------------------
#: a model worker that shows no progress (``interrupt.beat``) for this long is wedged; well above any
#: legitimate step (a prefill chunk, a graph node, a decoded token; a load reports progress too)
DEFAULT_WEDGE_S = 120.0
#: the exit status when ``--exit-when-wedged`` stops a daemon whose worker is wedged
EXIT_WEDGED = 3
#: a decode stream's frames at most this often (``modeld.coalesce``; what it costs and saves: docs/daemon.md)
DEFAULT_STREAM_INTERVAL_S = 0.050
#: how much nicer the model workers (and the engine threads they start) run than the IO thread: none by default.
#: A nicer engine answers status a few ms sooner during a decode, but loses the cores to any other busy program:
#: beside two CPU-bound processes on two cores, nice 10 left the engine about a tenth of a core's time
#: (``modeld.priority``), and an agent's first request took minutes where it takes seconds
DEFAULT_ENGINE_NICE = 0
#: the nicest a thread can be
MAX_NICE = 19

# --- snapshot blobs ---------------------------------------------------------------------------------------------
#: disk for snapshot blobs; the least recently used are pruned beyond it
DEFAULT_BLOB_BYTES = 4 * 2**30

# --- the HTTP front ---------------------------------------------------------------------------------------------
#: where ``modeld http`` listens when no --http says (``serve`` serves no front then)
DEFAULT_LISTEN = "127.0.0.1:8377"
#: how long a request waits for the slot while another holds it, then 503
QUEUE_TIMEOUT_S = 300.0
#: how long a streamed request waits for the slot before its response starts: past it, the stream starts and
#: sends its API's keep-alives while the request waits on (Qwen Code gives up after 120 s without response
#: headers); a refusal after that is the stream's error event, not a status code
STREAM_GRACE_S = 15.0
#: the largest request body accepted: far above the largest agent request measured (~22k tokens of
#: prompt, tools included, is about 1 MB of JSON); a larger one is refused with 413 before parsing
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
#: open HTTP connections the front serves at once (agents hold a few; a browser tab six)
DEFAULT_MAX_CONNECTIONS = 512
#: seconds a connection may take to send a request head
DEFAULT_HEADER_TIMEOUT_S = 30.0
#: seconds a paused WebSocket generation holds the slot before it is ended (``/v1/ws``'s ``pause``)
DEFAULT_WS_PAUSE_LIMIT_S = 60.0
#: images a request may carry, each at most this many bytes (OpenAI's limit per image) and pixels (the size is
#: read from the header, before anything is decoded: a small file that claims 50,000 x 50,000 is refused unread)
DEFAULT_MAX_IMAGES = 16
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 32 * 1024 * 1024
#: an image URL fetched under --allow-image-urls: seconds in all (lookups, redirects, body), redirects followed
IMAGE_FETCH_TIMEOUT_S = 10.0
IMAGE_FETCH_REDIRECTS = 3
