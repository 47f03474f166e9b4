"""Context parallelism (CP): one micro-batch's sequence split over the ranks of a CP group.

The room for everything CP adds, one module per concern:

- ``rules.py``: what the flags must satisfy under CP (pure; ``validation.validate`` calls it);
- ``layout.py``: which tokens each CP rank holds and which keys each of its queries attends to
  (pure, host-side: per-document head-tail for packed documents, row head-tail otherwise);
- ``collectives.py``: the one collective, the local [K;V] all-gathered (reduce-scattered backward);
- ``attention.py``: the core attention's CP path (a plan per micro-batch; the CPU flash pieces, one
  flash varlen call on CUDA) and its run-time guards; ``model/attention.py`` calls it.

Invariant: a micro-batch trained under CP c gives the loss and the gradients of the same
micro-batch in one process (with the same document pad multiple g): every CP rank holds 1/c of its
tokens, every query attends to exactly the keys of its own document (or row) at or before its
position, gathered from the whole CP group, and the loss and token counts are summed over DP x CP.
docs/context-parallel.md draws the layout and says when CP beats more TP or PP.
"""
