"""The ArrayRecord format: the C reader of riegeli chunks (_riegeli.c), the chunk layout of one file (arrayrecord),
the compact index of a whole dataset (index) and what a dataset is (source: a converted directory, a TFDS directory,
a glob or a list of shards). It imports no other part of the loader."""
