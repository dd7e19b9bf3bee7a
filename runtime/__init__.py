"""The modeld runtime: the client library a coding agent imports, and the CLI."""

from .client import Client, RemoteSession

__all__ = ["Client", "RemoteSession"]
