"""scikit-learn's digits as a TFDS dataset: `tfds build pipelines/datasets/digits --data_dir D`."""
