"""The Kaiten gateway: OpenAI-compatible HTTP and WebSocket API in front of the engine workers."""
from gateway.app import create_app
from gateway.cli import main

__all__ = ["create_app", "main"]
