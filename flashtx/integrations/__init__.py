"""Integrations with other libraries. Each submodule imports its library only when used:
``flashtx.integrations.transformers`` (Hugging Face transformers, the ``hf`` extra)."""
