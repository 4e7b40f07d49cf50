"""Export: the checkpoint as safetensors, and as a Hugging Face transformers model (remote code)."""
