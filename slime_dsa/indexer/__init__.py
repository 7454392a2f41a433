"""DSA indexer training outside RL: the dense warm-up that turns a dense-attention checkpoint into a DSA model.

  evaluate.py  recall of the indexer's top-k and the LM loss of the model, sparse vs dense
  warmup.py    freeze / re-initialise indexers, the text corpus, the warm-up loop (`slime-dsa indexer-warmup`)
The loss itself is a pure function in slime_dsa/algorithms/indexer_loss.py.
"""
