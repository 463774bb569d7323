"""Compile internals behind :func:`functrain.jit` (private: the public surface is ``functrain.jit``).

- :mod:`.backend`: the inductor options jit sets (torch version workarounds, CPU defaults, dropout masks,
  one C++ compiler per idle core: :mod:`.workers`), with inductor's kernel templates made lazy
  (:mod:`.lazy_templates`) and its precompiled header found without ``g++ -E`` (:mod:`.header_cache`);
- :mod:`.guards`: the filter that skips dynamo's guards on library globals;
- :mod:`.cache`: the portable compile cache (``jit(..., cache_dir=...)``) and the compile-time estimate
  (:mod:`.compile_times`), with the vector-ISA verdict and functrain's per-user cache (:mod:`.isa_probe`);
- :mod:`.cache_hits`: the fast path, a compiled graph called directly when its guards pass;
- :mod:`.wrappers`: what jit wraps a step in (donation, kept layouts, a code object of its own, the eager
  forward before the first trace);
- :mod:`.traceable`: the model made traceable while dynamo traces (:mod:`.rnn`, :mod:`.attention_paths`,
  :mod:`.quiet_logging`, torch.utils.checkpoint through :mod:`functrain.remat`), set for the trace by
  :func:`functrain.core.patch.patched` (below :mod:`functrain.remat`, which uses it too).

Nothing is imported here: what a module needs of jit's internals it imports itself.
"""
