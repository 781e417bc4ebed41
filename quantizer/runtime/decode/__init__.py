"""Decoding: the fast decoder for Llama-shaped stacks (``decoder``), its ahead-of-time compiled
step (``compiled``), and greedy generation with streaming text (``generation``)."""
