"""The HTTP server's parts (scripts/chat_serve.py): its engines, and the guards in front of its routes."""
