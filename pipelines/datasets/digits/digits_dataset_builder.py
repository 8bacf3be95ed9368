"""TFDS builder for scikit-learn's handwritten digits; builds offline (the data ships in sklearn).

    tfds build pipelines/datasets/digits --data_dir ~/tensorflow_datasets --file_format=tfrecord
    tfds build pipelines/datasets/digits --data_dir ~/tensorflow_datasets --file_format=array_record
"""

import tensorflow_datasets as tfds

from pipelines.demo import digits_splits


class Builder(tfds.core.GeneratorBasedBuilder):
    """1,797 8x8 grey images of digits 0-9, split 80/20 into train/test."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(8, 8, 1)),
                "label": tfds.features.ClassLabel(num_classes=10),
            }),
            supervised_keys=("image", "label"),
            homepage="https://scikit-learn.org/stable/modules/generated/sklearn.datasets.load_digits.html",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        del dl_manager  # nothing to download
        return {split: self._generate_examples(images, labels) for split, (images, labels) in digits_splits().items()}

    def _generate_examples(self, images, labels):
        for i, (image, label) in enumerate(zip(images, labels)):
            yield i, {"image": image[..., None], "label": int(label)}
