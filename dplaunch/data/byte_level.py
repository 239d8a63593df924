"""The built-in byte-level tokenizer's core (259 tokens), torch- and transformers-free: the launch
checks count tokens with it, and the ranks wrap it as an HF tokenizer (dplaunch.train.tokenizer)."""

from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def byte_level_core():
    """The `tokenizers` core of the byte-level tokenizer: every UTF-8 byte one token, ids 0-2 the
    special tokens (matched whole in a text, as a chat template writes them). Needs no torch or
    transformers: the launch check counts tokens with it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 2)]
    )
    core.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    return core
