"""Structured outputs: constraints on a request's output (params.py, torch-free) and,
on workers, their compilation and per-step token masks (the rest of this package).

    params.py        StructuredOutputs: the constraint every layer takes (router, proto, engine)
    backend.py       the interface: GrammarBackend.compile -> CompiledGrammar.matcher() ->
                     GrammarMatcher (accept_token, fill_bitmask, rollback, is_terminated, fork);
                     the vocabulary (tokenizer.json, the model's vocab_size, EOS ids); bitmasks
    xgrammar_backend.py, llguidance_backend.py   the two engines, imported only when chosen
    compiler.py      off the step: a thread pool, a deadline, an LRU cache; admission limits; stats
    manager.py       the engine's side: compiles per group, matchers per sequence, masks
                     (a speculative verification's K+1 rows each at its own position)
    build.py         a manager from an EngineConfig

A constrained request's life in the engine (engine/core.py):

    add_request --check limits--> compiling (admitted, not scheduled; polled each step)
        |-- refused / past the deadline --> FAILED (INVALID_CONSTRAINT / CONSTRAINT_TIMEOUT)
        `-- compiled --> matcher per sequence (resumed tokens accepted) --> scheduled
              each step: mask its row -> sample -> apply_token -> matcher.accept_token
              grammar complete --> FINISHED ("stop")

Under speculative decoding constrained sequences draft too: the drafts are cut at the
first one the grammar refuses (before the forward pass), the verification's K+1 rows
are masked each at its position (the matcher walks the drafts, then rolls back), and
only the tokens the verification emits enter the matcher, through apply_token: the
output is the non-speculative one, token for token (manager.py's diagram).
"""
