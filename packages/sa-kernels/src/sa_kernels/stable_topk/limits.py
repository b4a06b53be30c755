"""The row lengths `stable_topk`'s kernels take: shared by the dispatch (`__init__`) and `gluon_kernels`."""

TRITON_MAX_ROW = 32768
"""Longest row the Triton path takes (the lengths it was run and timed at on the GPU); longer rows take
the PyTorch path."""
