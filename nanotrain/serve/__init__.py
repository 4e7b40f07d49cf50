"""The HTTP server's parts (scripts/chat_serve.py): continuous batching, its process, the request record, and the
guards in front of its routes."""
