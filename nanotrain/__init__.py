"""nanotrain: a minimal, hackable, pure-PyTorch repo that trains a chat LLM end to end."""
__version__ = "0.1.0"
