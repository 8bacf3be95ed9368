"""Records to arrays: tf.train.Example and TFDS features (decode) and images (images, with the C JPEG crop decoder
_jpeg.c). It imports no other part of the loader."""
