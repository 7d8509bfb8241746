"""The training API: what a script calls (``ea.State``, ``ea.run``, ``ea.ElasticData``, warm
joiners,
the collective clock, TensorBoard summaries, the sample audit)."""
