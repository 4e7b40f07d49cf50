"""The server's side of generation: continuous batching, its process, the request record (scripts/chat_serve.py)."""
