"""Speculative decoding: off against ngram, draft_model and eagle3 (`methods`), and its
GPU mode on larger random models (`gpu`)."""
