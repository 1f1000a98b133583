"""Building blocks every model family is made of: norms, rotary embeddings, merged linear
projections, attention over the paged cache, MLP and MoE. One file each."""
