"""Speculative decoding: a proposer guesses K tokens, the target checks them in one pass.

    config.py   SpeculativeConfig, the `speculative_config` a user gives (vLLM's shape)
    ngram.py    the prompt-lookup proposer (drafts copied from earlier in the sequence)
    verify.py   which drafts a sequence keeps, given the target's results at each position
"""
