"""The megatron-core backend: GLM-MoE-DSA built from megatron-core pieces (TP linear layers, vocab-parallel
embedding, the MoE layer and its router) around our DSA attention, trained by the shared step (trainers/rank.py)."""
