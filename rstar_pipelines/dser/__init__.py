"""Deep Self-Evolving Reasoning (DSER, docs/dser.md): many parallel chains of
verify-then-refine over one solution each, a Markov view of their correctness
(`markov`), and a plurality vote over the late states of all chains (`vote`)."""
