"""TFDS dataset builders shipped with the project (`tfds build pipelines/datasets/<name>`)."""
