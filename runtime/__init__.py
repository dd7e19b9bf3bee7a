"""The modeld runtime: the client library a coding agent imports, and the CLI."""

from .chat import Chat, ChatEvent, ChatResult, ChatTiming, ChatTurn, ChatUsage
from .client import Client, RemoteSession

__all__ = ["Chat", "ChatEvent", "ChatResult", "ChatTiming", "ChatTurn", "ChatUsage", "Client", "RemoteSession"]
