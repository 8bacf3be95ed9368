"""What each batch holds, computed from counts and seeds alone: the global permutation (permutation), the batches of
one host (batches), mixtures of datasets (mixture), token counts (counts) and packed rows (packing, with its C packer
_pack.c). It reads no record and builds on the format (loader/format) only."""
