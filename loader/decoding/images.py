"""Image ops for the loader: decode JPEG/PNG, Inception-style random-resized crop and flip for training, resize and
center crop for evaluation. uint8 RGB out; normalising is left to the device.

    import loader
    from loader import images  # (this module)

    train = loader.load("imagenet/", batch_size=256, seed=0,
                        random_map_fn=images.RandomResizedCrop("image/encoded", size=224))
    batch = next(iter(train))   # {"image": uint8 [256, 224, 224, 3], "image/class/label": int64 [256], ...}
    evaluate = loader.load("imagenet-val/", batch_size=256, shuffle=False,
                           map_fn=images.CenterCrop("image/encoded", size=224))

Decoders, measured one thread on ImageNet-like photos (benchmarks/image_bench.py, docs/benchmarks.md): simplejpeg
(libjpeg-turbo) decodes fastest, ahead of OpenCV and well ahead of Pillow, and scales the DCT (a 1/2, 1/4 ... decode)
when the crop is large; OpenCV resizes (the fastest resize measured) and decodes what is not a JPEG (PNG, ...). Both
release the GIL, so the loader's threads decode in parallel.

Hostile or damaged files (tests/fixtures/fuzz/images): a decoder allocates for the size an image's header declares, not
for the data behind it (a progressive JPEG's whole coefficient buffer: 239 bytes declaring 30000x30000 took 2.6 GB in a
crop, 5 GB in a whole decode), so the header is read first and an image declaring more than `max_pixels` pixels (default
MAX_IMAGE_PIXELS, Pillow's decompression-bomb limit) is an error before anything decodes. A JPEG or PNG without its end
marker (cut short) is an error too, and a JPEG decodes through libjpeg-turbo or not at all: its warnings (corrupt data)
are errors, where OpenCV would pad what it cannot read with grey. An EXIF orientation is not applied (as
TensorFlow's decoders do not): the pixels come in the order they are stored.

A crop depends only on the record's bytes and the `numpy.random.Generator` the loader hands `random_map_fn` (seeded
from the loader's seed, the epoch and the record's global index), so an augmented batch is the same for any host
count, worker count and after a resume.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import struct
from collections.abc import Iterator

import numpy as np

JPEG_MAGIC = b"\xff\xd8"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNG_END = b"IEND\xaeB`\x82"  # the IEND chunk's type and CRC (it holds no data, so its CRC is fixed)
# A whole image's end marker (JPEG's FF D9, PNG's IEND chunk) mostly lies within its last bytes: the quick test.
# Where it does not, the file's structure is walked to its end marker (a trailer follows some: a phone's "motion
# photo" appends a video to its JPEG).
EOI_WITHIN = 1024
# The most pixels (height x width) an image may declare: Pillow's decompression-bomb error threshold (2 x 89,478,485),
# above any camera's photos. At the cap, a progressive JPEG's coefficients take 1 GB (6 bytes a pixel; a CMYK one, 4
# components, 1.4 GB), its RGB 0.5 GB.
MAX_IMAGE_PIXELS = 2 * 89_478_485
# The most scans a JPEG may have (loader/decoding/_jpeg.c's MAX_SCANS): a progressive JPEG has ~10, and each scan
# decodes every block again, so a file of thousands of tiny scans is a CPU bomb (12 s a decode for 4,000 of them).
MAX_SCANS = 200

# The Inception crop as torchvision's RandomResizedCrop takes it: 8%-100% of the area, aspect 3:4 to 4:3 (log-uniform),
# 10 tries, then a central crop. (big_vision's inception_crop samples 5%-100% through TF's
# sample_distorted_bounding_box, 100 tries, then the whole image.)
AREA_RANGE = (0.08, 1.0)
ASPECT_RANGE = (3 / 4, 4 / 3)
ATTEMPTS = 10
# Evaluation: resize the short side to size / CROP_FRACTION, then take the central size x size (224 of 256).
CROP_FRACTION = 0.875


def _cv2():
    import cv2

    cv2.setNumThreads(1)  # the loader's threads are the parallelism; OpenCV's own pool would oversubscribe cores
    return cv2


def _described(data) -> str:
    return f"{len(data)} bytes starting {bytes(data[:8])!r}"


def _check_pixels(height: int, width: int, max_pixels: int) -> None:
    if height * width > max_pixels:
        raise ValueError(f"an image declaring {height}x{width} = {height * width:,} pixels, over "
                         f"max_pixels={max_pixels:,} (a decompression bomb?); pass a larger max_pixels= to the image "
                         "op if your images really are this large")


def _declared_size(data, max_pixels: int) -> tuple[int, int] | None:
    """(height, width) from a JPEG's or a PNG's header, refused over `max_pixels` before anything decodes; None for
    other formats (OpenCV reads their headers: its own limit, OPENCV_IO_MAX_IMAGE_PIXELS, 2^30, bounds their decode, and
    `max_pixels` is checked on what it decoded)."""
    if data[:2] == JPEG_MAGIC:
        height, width = _jpeg_frame_size(data)
    elif data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])  # IHDR: width, height (4 bytes each, big-endian), ...
    else:
        return None
    _check_pixels(height, width, max_pixels)
    return height, width


# JPEG's frame headers (SOF0-SOF15 but DHT, JPG and DAC): the image's precision, height and width follow the length
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_frame_size(data) -> tuple[int, int]:
    """(height, width) from a JPEG's frame header (SOFn), read here: simplejpeg's header call refuses sampling
    factors TurboJPEG does not name (4:4:1, what a lossless 90-degree turn of a 4:1:1 JPEG gives, raised KeyError: 6),
    which libjpeg decodes."""
    for marker, i in _jpeg_markers(data):
        if marker in (0xDA, 0xD9):  # a scan or the end before any frame header
            break
        if marker in _SOF_MARKERS:
            if int.from_bytes(data[i + 2:i + 4], "big") < 8 or i + 9 > len(data):
                break
            height, width = int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 7:i + 9], "big")
            if height == 0 or width == 0:
                raise ValueError(f"{_described(data)}: a JPEG declaring {height}x{width} pixels (a height defined "
                                 "later by a DNL marker, which libjpeg does not support, or no width): not an image "
                                 "that decodes")
            return height, width
    raise ValueError(f"{_described(data)}: not a JPEG that decodes (no frame header (SOF) before its first scan)")


def _check_whole(data) -> None:
    """Refuse a JPEG or PNG whose structure stops before its end marker: a file cut short. A crop decode stops below its
    window and OpenCV pads missing rows with grey, so neither would tell. An empty value is refused here too (OpenCV's
    own words were an assertion on `!buf.empty()`)."""
    if len(data) == 0:
        raise ValueError("an empty value (0 bytes), not an image: the record holds no image in this feature; leave "
                         "the record out, or fill the feature, and convert again")
    if data[:2] == JPEG_MAGIC:
        if bytes(data[-EOI_WITHIN:]).rfind(b"\xff\xd9") < 0 and not _jpeg_reaches_its_end(bytes(data)):
            raise ValueError(f"{_described(data)}: a JPEG whose markers stop before its end-of-image marker (FF D9): "
                             "the file was cut short; replace it or leave the record out")
    elif data[:8] == PNG_MAGIC and bytes(data[-EOI_WITHIN:]).rfind(PNG_END) < 0 and not _png_reaches_its_end(data):
        raise ValueError(f"{_described(data)}: a PNG whose chunks stop before its IEND chunk: the file was cut short; "
                         "replace it or leave the record out")


def _jpeg_reaches_its_end(data: bytes) -> bool:
    """Whether a JPEG's markers lead to its end-of-image marker (FF D9) before the data ends."""
    return _jpeg_walk(data)[0]


def _check_scans(data) -> None:
    """Refuse a JPEG of more than MAX_SCANS scans before simplejpeg decodes it (_jpeg.c stops at the same count): a
    quick count of the SOS marker's bytes first (they may also lie in other segments, or in a trailer), walked
    exactly only where that count is over."""
    if bytes(data).count(b"\xff\xda") > MAX_SCANS and _jpeg_walk(bytes(data))[1] > MAX_SCANS:
        raise ValueError(f"{_described(data)}: not a JPEG that decodes (more than {MAX_SCANS} scans (a progressive "
                         "JPEG has ~10; each scan decodes every block again: a CPU bomb?))")


def _jpeg_walk(data: bytes) -> tuple[bool, int]:
    """(whether a JPEG's markers lead to its end-of-image marker (FF D9) before the data ends, the scans on the way)."""
    scans = 0
    for marker, _ in _jpeg_markers(data):
        if marker == 0xD9:
            return True, scans
        scans += marker == 0xDA
    return False, scans


def _jpeg_markers(data) -> Iterator[tuple[int, int]]:
    """(marker, its offset) of a JPEG's segments after its SOI, up to its end-of-image marker (FF D9, the last):
    each segment skipped by its length, each scan's entropy-coded data to the next marker that is not a stuffed FF 00,
    a restart marker or fill; markers without a length (fill, restarts, TEM) passed over. Stops early where the data
    ends or holds no marker where one must be (damaged: libjpeg names it when it decodes). One pass, each step moving
    forward; what follows the end marker (a trailer) is not read."""
    n, i = len(data), 2
    while i + 2 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xD9:
            yield marker, i
            return
        if marker in (0xFF, 0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # fill, SOI, TEM, a restart: no length
            i += 1 if marker == 0xFF else 2
            continue
        if i + 4 > n or int.from_bytes(data[i + 2:i + 4], "big") < 2:
            return
        yield marker, i
        i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
        if marker == 0xDA:  # a scan: its entropy-coded data runs to the next real marker
            while True:
                i = data.find(b"\xff", i)
                if i < 0 or i + 1 >= n:
                    return
                following = data[i + 1]
                if following != 0x00 and not 0xD0 <= following <= 0xD7 and following != 0xFF:
                    break  # a marker: the outer loop reads it
                i += 1 if following == 0xFF else 2


def _png_reaches_its_end(data) -> bool:
    """Whether a PNG's chunks, each skipped by its length, lead to its IEND chunk before the data ends."""
    n, i = len(data), len(PNG_MAGIC)
    while i + 12 <= n:
        length, kind = struct.unpack(">I4s", bytes(data[i:i + 8]))
        if kind == b"IEND":
            return True
        i += 12 + length  # length, type, data, CRC
    return False


def image_size(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """(height, width) of an encoded image, from its header (JPEG, PNG; other formats decode). An image declaring more
    than `max_pixels` pixels is a ValueError."""
    size = _declared_size(data, max_pixels)
    if size is None:
        size = decode(data, max_pixels=max_pixels).shape[:2]
    return size


def decode(data: bytes, *, min_height: int = 0, min_width: int = 0,
           max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """An encoded image (JPEG, PNG, or anything OpenCV reads) -> uint8 [H, W, 3] RGB. With `min_height`/`min_width`,
    a JPEG may decode scaled down (a DCT-domain 1/2 .. 1/8 decode) as long as it keeps at least that size. A ValueError
    for an image that does not decode, declares more than `max_pixels` pixels, or is cut short."""
    size = _declared_size(data, max_pixels)
    _check_whole(data)
    if size is not None and data[:2] == JPEG_MAGIC and (min_height or min_width):
        n = _crop_scale(size[0], size[1], (min_height, min_width))
        min_height, min_width = -(-size[0] * n // 8), -(-size[1] * n // 8)
    return _decoded(data, size, min_height, min_width, max_pixels)


def _decoded(data, size: tuple[int, int] | None, min_height: int, min_width: int, max_pixels: int) -> np.ndarray:
    """`decode` once `_declared_size` gave `size` and `_check_whole` passed."""
    if data[:2] == JPEG_MAGIC:
        import simplejpeg

        _check_scans(data)
        try:  # simplejpeg converts CMYK/YCCK too; its strict mode makes libjpeg's warnings (corrupt data) errors
            return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True, fastupsample=True,
                                          min_height=min_height, min_width=min_width)
        except (ValueError, KeyError) as e:  # not on to OpenCV: it ignores those warnings and pads what it cannot read
            said = f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)  # with grey
            if (isinstance(e, KeyError) or "subsampling" in said) and (jpeg := _crop_decoder()) is not None:
                return _whole_through_libjpeg(jpeg, data, min_height, min_width, max_pixels)
            if isinstance(e, KeyError) or "subsampling" in said:
                said += ("; its chroma sampling is one TurboJPEG's whole decode does not take (4:4:1, 4:1:0, ...): "
                         "libjpeg decodes it through loader/decoding/_jpeg.c, which is not built here")
            raise ValueError(f"{_described(data)}: not a JPEG that decodes ({said})") from None
    cv2 = _cv2()
    # (as for JPEGs, and as TensorFlow decodes: an EXIF orientation is not applied; OpenCV applied it to a PNG, whose
    # crop box is measured on the unrotated size from its header, and the crop came out stretched)
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if image is None:
        if data[:8] == PNG_MAGIC:  # OpenCV gives no reason: the first chunk that is damaged, where one is
            raise ValueError(f"{_described(data)}: not a PNG that decodes ({_png_damage(data)})")
        raise ValueError(f"{_described(data)} are not an image that decodes (JPEG, PNG, or another format OpenCV "
                         "reads)")
    if size is None:
        _check_pixels(image.shape[0], image.shape[1], max_pixels)
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _whole_through_libjpeg(jpeg, data, min_height: int, min_width: int, max_pixels: int) -> np.ndarray:
    """A whole JPEG decoded by _jpeg.c (a crop of the whole image), at the smallest n/8 keeping min_height x
    min_width: for what TurboJPEG's whole decode refuses."""
    if not min_height and not min_width:  # full size (0 x 0 would be the smallest scale)
        min_height = min_width = 1 << 30
    try:
        pixels, rows, cols, _, _ = jpeg.crop(data, 0, 0, 0, 0, min_height, min_width, max_pixels)
    except NotImplementedError as e:
        raise ValueError(f"{_described(data)}: not a JPEG that decodes ({e})") from None
    return np.frombuffer(pixels, np.uint8).reshape(rows, cols, 3).copy()


def _png_damage(data) -> str:
    """Why a PNG that OpenCV would not decode does not: its first chunk whose length overruns the file or whose CRC
    does not match, or else that its chunks are whole (the image data itself is damaged)."""
    import zlib

    data = bytes(data)
    at = len(PNG_MAGIC)
    while at + 12 <= len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        kind = data[at + 4:at + 8]
        name = kind.decode("latin-1") if kind.isalpha() else repr(kind)
        if length > len(data) - at - 12:  # (bounded before it is used)
            return f"its {name} chunk at byte {at} declares {length:,} bytes, past the end of the file"
        stored = int.from_bytes(data[at + 8 + length:at + 12 + length], "big")
        if zlib.crc32(data[at + 4:at + 8 + length]) != stored:
            return f"its {name} chunk at byte {at} fails its CRC: a damaged byte"
        if kind == b"IEND":
            return "its chunks are whole and their CRCs match: the image data they hold does not decode"
        at += 12 + length
    return f"it ends at byte {len(data)} inside a chunk header, before its IEND chunk"


def sample_crop(rng: np.random.Generator, height: int, width: int, *, area_range=AREA_RANGE,
                aspect_range=ASPECT_RANGE, attempts: int = ATTEMPTS) -> tuple[int, int, int, int]:
    """An Inception-style crop box (top, left, h, w) of an image of height x width: area a uniform fraction in
    `area_range` of the image, log-uniform aspect (w/h) in `aspect_range`; after `attempts` misses, the largest
    central box of an aspect within the range."""
    total = height * width
    log_low, log_high = math.log(aspect_range[0]), math.log(aspect_range[1])
    for _ in range(attempts):
        area = total * rng.uniform(*area_range)
        aspect = math.exp(rng.uniform(log_low, log_high))
        w = int(round(math.sqrt(area * aspect)))
        h = int(round(math.sqrt(area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    aspect = width / height
    if aspect < aspect_range[0]:
        w, h = width, int(round(width / aspect_range[0]))
    elif aspect > aspect_range[1]:
        h, w = height, int(round(height * aspect_range[1]))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    if image.shape[:2] == (height, width):  # a copy: never a read-only view of the decoder's bytes, nor of the
        return np.array(image)               # caller's array (as every resized crop is its own)
    cv2 = _cv2()
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR)


def _rgb(image: np.ndarray) -> np.ndarray:
    """A decoded uint8 image as [H, W, 3], as decoding its PNG would give: grey ([H, W], [H, W, 1]) repeated, an alpha
    channel ([H, W, 2] grey and alpha, [H, W, 4] RGBA) dropped; uint16 as 8 bits (the high byte, as a 16-bit PNG
    decodes)."""
    if image.dtype == np.uint16:
        image = (image >> 8).astype(np.uint8)
    elif image.dtype != np.uint8:
        raise ValueError(f"a decoded image of dtype {image.dtype}: the image ops take uint8 pixels (or uint16, taken "
                         "to 8 bits); convert it first, e.g. np.clip(image * 255, 0, 255).astype(np.uint8) for floats "
                         "in [0, 1]")
    if image.ndim == 3 and image.shape[2] in (3, 4):
        return image[:, :, :3]
    if image.ndim == 2 or (image.ndim == 3 and image.shape[2] in (1, 2)):
        return np.repeat(image.reshape(image.shape[0], image.shape[1], -1)[:, :, :1], 3, axis=2)
    raise ValueError(f"a decoded image of shape {image.shape}: expected [H, W] or [H, W, C] with C of 1 to 4")


def _crop_decoder():
    """loader.decoding._jpeg (libjpeg crop decode), or None where it was not built (no libjpeg headers at install)."""
    try:
        from loader.decoding import _jpeg
    except ImportError:
        return None
    return _jpeg


@functools.cache
def _say_if_crops_decode_whole() -> None:
    """Once a process, where a crop op is made: a log line when _jpeg.c was not built, since crops then decode whole
    JPEGs (the same pixels, at about the same CPU on ~50 KB photos), and a user would otherwise never learn why."""
    if _crop_decoder() is None:
        logging.getLogger(__name__).info(
            "loader.decoding._jpeg is not built (libjpeg's headers were missing when the package was built): crops "
            "decode whole JPEGs through simplejpeg, at the same scale, with the same pixels. For the crop decode, "
            "install libjpeg-turbo's headers (apt install libjpeg-turbo8-dev or libjpeg-dev; dnf install "
            "libjpeg-turbo-devel) and build again (pip install -e ., or python setup.py build_ext --inplace)")


def decode_crop(data, box: tuple[int, int, int, int], min_size: tuple[int, int], *,
                max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """The `box` (top, left, h, w) of an encoded image (or of a decoded array) as uint8 [h', w', 3] RGB, at the
    smallest scale n/8 that keeps it at least `min_size` (h, w) pixels (or full size when it is smaller). A JPEG
    decodes only the box's rows and columns (loader/decoding/_jpeg.c, like tf.image.decode_and_crop_jpeg) and a scaled
    DCT; other formats decode whole, then the box is cut out. The errors of `decode`."""
    top, left, h, w = box
    if isinstance(data, np.ndarray):
        image = _rgb(data)
    else:
        _check_whole(data)
        if data[:2] == JPEG_MAGIC and (jpeg := _crop_decoder()) is not None:
            try:
                pixels, rows, cols, x_offset, n = jpeg.crop(data, top, left, h, w, *min_size, max_pixels)
            except NotImplementedError:  # CMYK/YCCK: simplejpeg converts it, below
                pass
            else:
                width = max(1, -(-(left + w) * n // 8) - left * n // 8)
                return np.frombuffer(pixels, np.uint8).reshape(rows, cols, 3)[:, x_offset:x_offset + width]
        size = _declared_size(data, max_pixels)
        if size is not None and data[:2] == JPEG_MAGIC:
            # simplejpeg (CMYK/YCCK, or _jpeg.c not built): the scale and the rounding of _jpeg.c, so that a crop has
            # the same pixels on either path (a host without the extension augments alike)
            n = _crop_scale(h, w, min_size)
            image = _decoded(data, size, -(-size[0] * n // 8), -(-size[1] * n // 8), max_pixels)
            y0, x0 = top * n // 8, left * n // 8
            return image[y0:max(y0 + 1, -(-(top + h) * n // 8)), x0:max(x0 + 1, -(-(left + w) * n // 8))]
        image = _decoded(data, size, 0, 0, max_pixels)  # PNG, and formats OpenCV reads: whole, once
    return image[top:top + max(h, 1), left:left + max(w, 1)]


def _crop_scale(h: int, w: int, min_size: tuple[int, int]) -> int:
    """n of the n/8 a JPEG crop decodes at: the smallest of 8, 4, 2, 1 whose h x w box keeps min_size, as _jpeg.c
    picks it (libjpeg-turbo's other scales, 3/8, 5/8 ..., take a slow IDCT, slower than a whole one)."""
    n = 8
    while n > 1 and h * (n // 2) // 8 >= min_size[0] and w * (n // 2) // 8 >= min_size[1]:
        n //= 2
    return n


def _sized(data, max_pixels: int) -> tuple:
    """(the image, its (height, width)) for a crop: a JPEG's or PNG's size from its header; an image of another format
    (WebP, BMP, ...), whose size takes its decode, decoded here once and handed on decoded."""
    if isinstance(data, np.ndarray):
        return data, data.shape[:2]
    size = _declared_size(data, max_pixels)
    if size is not None:
        return data, size
    image = decode(data, max_pixels=max_pixels)
    return image, image.shape[:2]


def random_resized_crop(data, rng: np.random.Generator, size: int, *, flip: bool = True,
                        area_range=AREA_RANGE, aspect_range=ASPECT_RANGE,
                        max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Encoded image (or a decoded uint8 [H, W, 3]) -> uint8 [size, size, 3]: an Inception crop (`sample_crop`)
    resized to size x size, mirrored left-right with probability 1/2 when `flip`. The JPEG decodes at the smallest
    DCT scale that keeps the crop at least `size` pixels on each side. The errors of `decode`."""
    data, (height, width) = _sized(data, max_pixels)
    top, left, h, w = sample_crop(rng, height, width, area_range=area_range, aspect_range=aspect_range)
    mirror = flip and rng.random() < 0.5
    out = _resize(decode_crop(data, (top, left, h, w), (size, size), max_pixels=max_pixels), size, size)
    return _cv2().flip(out, 1) if mirror else out  # (NumPy copies a reversed 3-byte-pixel view ~20x slower)


def center_crop(data, size: int, *, crop_fraction: float = CROP_FRACTION,
                max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Encoded image (or a decoded uint8 [H, W, 3]) -> uint8 [size, size, 3]: the short side resized to
    size / crop_fraction, then the central size x size. The errors of `decode`."""
    data, (height, width) = _sized(data, max_pixels)
    # The central square of side min(H, W) * crop_fraction, resized to size (the same pixels as resizing the short
    # side to size / crop_fraction and cutting the central size x size, with only the crop decoded).
    side = max(1, int(round(min(height, width) * crop_fraction)))
    box = ((height - side) // 2, (width - side) // 2, side, side)
    return _resize(decode_crop(data, box, (size, size), max_pixels=max_pixels), size, size)


def _image_of(record, feature: str):
    """The encoded bytes (or decoded array) of `feature` in a decoded record."""
    if not isinstance(record, dict) or feature not in record:
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise KeyError(f"no image feature {feature!r} in this record (it has {got}); pass the feature that holds "
                       "the encoded image, e.g. 'image/encoded' for ImageNet-layout TFRecords or 'image' for TFDS")
    value = record[feature]
    if isinstance(value, np.ndarray) and value.dtype == object:
        value = value.item() if value.size == 1 else value
    if isinstance(value, (np.ndarray, np.generic)) and (value.ndim not in (2, 3) or value.dtype.kind not in "uif"):
        raise ValueError(f"feature {feature!r} holds a {value.dtype} array of shape {value.shape}, not an image: "
                         "encoded JPEG/PNG bytes, or pixels [H, W] or [H, W, C]; pass the image feature")
    return value


def _in_feature(feature: str, op, *args, **kwargs) -> np.ndarray:
    """op(*args) with an error naming the feature (the loader adds the shard and record)."""
    try:
        return op(*args, **kwargs)
    except ValueError as e:
        raise ValueError(f"feature {feature!r}: {e}") from e


def _check_max_pixels(max_pixels) -> None:
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ValueError(f"max_pixels must be a whole number of pixels >= 1 (got max_pixels={max_pixels!r}); the "
                         f"default, MAX_IMAGE_PIXELS, is {MAX_IMAGE_PIXELS:,}")


def _replace(record: dict, feature: str, output: str, image: np.ndarray) -> dict:
    out = {k: v for k, v in record.items() if k != feature}
    out[output] = image
    return out


@dataclasses.dataclass(frozen=True)
class RandomResizedCrop:
    """`random_map_fn=` for training: record[feature] (encoded bytes, or a decoded array) -> record[output], an
    uint8 [size, size, 3] Inception crop, flipped at random (`random_resized_crop`). The encoded feature is dropped.
    An image declaring more than `max_pixels` pixels is an error before it decodes (a decompression bomb)."""

    feature: str = "image"
    size: int = 224
    flip: bool = True
    output: str = "image"
    area_range: tuple[float, float] = AREA_RANGE
    aspect_range: tuple[float, float] = ASPECT_RANGE
    max_pixels: int = MAX_IMAGE_PIXELS

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be >= 1 pixel (got size={self.size})")
        if not 0 < self.area_range[0] <= self.area_range[1] <= 1:
            raise ValueError(f"area_range must satisfy 0 < low <= high <= 1 (got area_range={self.area_range})")
        if not 0 < self.aspect_range[0] <= self.aspect_range[1]:
            raise ValueError(f"aspect_range must satisfy 0 < low <= high (got aspect_range={self.aspect_range})")
        _check_max_pixels(self.max_pixels)
        _say_if_crops_decode_whole()

    @property
    def encoded_features(self) -> tuple[str, ...]:
        """Features the loader hands over still encoded (a TFDS Image stays PNG/JPEG bytes: decoded here, faster)."""
        return (self.feature,)

    def __call__(self, record: dict, rng: np.random.Generator) -> dict:
        image = _in_feature(self.feature, random_resized_crop, _image_of(record, self.feature), rng, self.size,
                            flip=self.flip, area_range=self.area_range, aspect_range=self.aspect_range,
                            max_pixels=self.max_pixels)
        return _replace(record, self.feature, self.output, image)


@dataclasses.dataclass(frozen=True)
class CenterCrop:
    """`map_fn=` for evaluation: record[feature] -> record[output], uint8 [size, size, 3] (`center_crop`). An image
    declaring more than `max_pixels` pixels is an error before it decodes."""

    feature: str = "image"
    size: int = 224
    output: str = "image"
    crop_fraction: float = CROP_FRACTION
    max_pixels: int = MAX_IMAGE_PIXELS

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be >= 1 pixel (got size={self.size})")
        if not 0 < self.crop_fraction <= 1:
            raise ValueError(f"crop_fraction must be in (0, 1] (got crop_fraction={self.crop_fraction})")
        _check_max_pixels(self.max_pixels)
        _say_if_crops_decode_whole()

    @property
    def encoded_features(self) -> tuple[str, ...]:
        return (self.feature,)

    def __call__(self, record: dict) -> dict:
        image = _in_feature(self.feature, center_crop, _image_of(record, self.feature), self.size,
                            crop_fraction=self.crop_fraction, max_pixels=self.max_pixels)
        return _replace(record, self.feature, self.output, image)
