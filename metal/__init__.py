"""Tree-attention kernel sources (Metal, CUDA), shipped as package data."""
