"""Text: tokenizers (a model's own, or the built-in one of the presets) and streaming detokenization with stop
strings."""
