"""dplaunch: one command for distributed training of Hugging Face models."""

__version__ = "0.1.0"
