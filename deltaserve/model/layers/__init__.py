"""The decoder's building blocks: gated full attention, Gated DeltaNet, dense SwiGLU and MoE."""
