"""Torch-free data: file formats, chat conversations, Arrow datasets, the byte-level tokenizer
core and the checks the launcher runs before any rank starts; the ranks read with the same code."""
