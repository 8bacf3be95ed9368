"""loader.decoding.images and random_map_fn: decode, crops, per-record randomness through the loader, bad images."""

import collections
import contextlib
import glob
import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import psutil
import pytest

import loader
from loader.decoding import images
from loader.planning.batches import record_rng
from tests.conftest import REPO

# Pinned: a change to the crop sampling or to the per-record seeding fails here loudly.
BOXES_375x500_SEED_0_EPOCH_0 = [(35, 302, 171, 129), (47, 118, 314, 295), (11, 112, 357, 343), (7, 72, 256, 335)]

# Crafted files (make_fuzz_images; the folder's README.md says what each is) and the error each gives on every path.
FUZZ_IMAGES = REPO / "tests" / "fixtures" / "fuzz" / "images"
BOMBS = {
    "bomb-progressive-30000x30000.jpg": "30000x30000 = 900,000,000 pixels, over max_pixels=178,956,970",
    "bomb-12000x16000.png": "12000x16000 = 192,000,000 pixels, over max_pixels=178,956,970",
}
DAMAGED = {
    "cmyk-cut-short.jpg": "the file was cut short",
    "cmyk-scan-cut-short.jpg": "Corrupt JPEG data",  # the end marker is there: libjpeg's warning tells
    "rgb-cut-short.jpg": "the file was cut short",
    "rgb-scan-cut-short.jpg": "Corrupt JPEG data",
    "cut-short.png": "the file was cut short",
}
WHOLE = ["cmyk.jpg"]


@pytest.fixture(scope="session")
def jpeg():
    from pipelines.demo import photo_jpegs

    return photo_jpegs(1, seed=5)[0][0]


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _pattern(height: int, width: int) -> np.ndarray:
    """RGB blocks of 16x16 pixels in random colours: it compresses like a picture, and a wrong decode shows."""
    rng = np.random.default_rng(0)
    return np.kron(rng.integers(0, 256, (height // 16, width // 16, 3), np.uint8), np.ones((16, 16, 1), np.uint8))


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def make_fuzz_images() -> dict[str, bytes]:
    """The crafted files of tests/fixtures/fuzz/images by name. `python -m tests.loader.decoding.test_images` writes
    them; the tests read the committed files (an encoder's bytes change between versions)."""
    import cv2
    from PIL import Image

    files = {}
    # A real 16x16 progressive JPEG whose frame header (SOF2) declares 30000x30000, cut after its first scan header,
    # its end-of-image marker put back: only the declared size gives it away.
    _, small = cv2.imencode(".jpg", _pattern(16, 16), [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])
    small, p = small.tobytes(), 2
    bomb = bytearray(small[:p])
    while small[p + 1] != 0xDA:  # up to the first SOS (start of scan) segment
        segment = bytearray(small[p:p + 2 + struct.unpack(">H", small[p + 2:p + 4])[0]])
        if segment[1] == 0xC2:  # SOF2: marker, length, precision, then height and width
            segment[5:9] = struct.pack(">HH", 30000, 30000)
        bomb += segment
        p += len(segment)
    files["bomb-progressive-30000x30000.jpg"] = bytes(bomb + small[p:p + 2 + struct.unpack(">H", small[p + 2:p + 4])[0]]
                                                      + b"\xff\xd9")
    # A whole, valid PNG: 12000x16000 black pixels of 1 bit compress to 24 KB and decode to 576 MB of RGB.
    height, width = 12000, 16000
    files["bomb-12000x16000.png"] = (b"\x89PNG\r\n\x1a\n"
                                     + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                                     + _png_chunk(b"IDAT", zlib.compress(bytes(height * (1 + width // 8)), 9))
                                     + _png_chunk(b"IEND", b""))
    picture = _pattern(256, 256)
    buffer = io.BytesIO()
    Image.fromarray(picture).convert("CMYK").save(buffer, "JPEG", quality=90)
    files["cmyk.jpg"] = cmyk = buffer.getvalue()
    rgb = cv2.imencode(".jpg", picture[:, :, ::-1])[1].tobytes()  # OpenCV writes BGR
    png = cv2.imencode(".png", picture[:, :, ::-1])[1].tobytes()
    for name, data in (("cmyk", cmyk), ("rgb", rgb)):
        files[f"{name}-cut-short.jpg"] = data[:len(data) // 2]
        files[f"{name}-scan-cut-short.jpg"] = data[:len(data) // 2] + b"\xff\xd9"
    files["cut-short.png"] = png[:len(png) // 2]
    return files


def _fuzz(name: str) -> bytes:
    return (FUZZ_IMAGES / name).read_bytes()


def test_crop_boxes_are_fixed_by_seed_epoch_and_record():
    assert [images.sample_crop(record_rng(0, 0, i), 375, 500) for i in range(4)] == BOXES_375x500_SEED_0_EPOCH_0
    assert images.sample_crop(record_rng(1, 2, 3), 375, 500) == (8, 136, 335, 308)
    # A tall sliver fits no box of aspect 3:4..4:3 inside it: the central box of the nearest aspect.
    assert images.sample_crop(record_rng(0, 0, 0), 1000, 10) == (493, 0, 13, 10)


def test_boxes_lie_inside_the_image_with_the_asked_area_and_aspect():
    rng = np.random.default_rng(0)
    for _ in range(500):
        height, width = (int(v) for v in rng.integers(16, 800, size=2))
        top, left, h, w = images.sample_crop(rng, height, width)
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h >= 1 and w >= 1
        aspect = w / h
        assert 3 / 4 * 0.9 < aspect < 4 / 3 * 1.1 or (h, w) in ((height, width), (height, w), (h, width))



def test_a_damaged_png_says_which_chunk(jpeg):
    """OpenCV refuses a damaged PNG without a reason: the error names the chunk that is damaged, or says that the
    chunks are whole (the compressed pixels themselves are damaged: a file crafted with CRCs to match)."""
    import cv2

    png = cv2.imencode(".png", images.decode(jpeg)[:, :, ::-1])[1].tobytes()
    idat = png.index(b"IDAT") - 4
    flipped = bytearray(png)
    flipped[idat + 100] ^= 0xFF  # a byte of the image data
    with pytest.raises(ValueError, match=rf"^{len(png)} bytes starting .*: not a PNG that decodes \(its IDAT chunk at "
                                         rf"byte {idat} fails its CRC: a damaged byte\)$"):
        images.decode(bytes(flipped))
    overrun = bytearray(png)
    overrun[idat:idat + 4] = (1 << 31).to_bytes(4, "big")  # a length past the file's end
    with pytest.raises(ValueError, match=rf"its IDAT chunk at byte {idat} declares 2,147,483,648 bytes, past the end"):
        images.decode(bytes(overrun))
    length = int.from_bytes(png[idat:idat + 4], "big")
    pixels = bytearray(png[idat + 8:idat + 8 + length])
    pixels[2:] = bytes(len(pixels) - 2)  # a zlib stream of zeros, its CRC recomputed: whole chunks, bad data
    forged = png[:idat] + _png_chunk(b"IDAT", bytes(pixels)) + png[idat + 12 + length:]
    with pytest.raises(ValueError, match=r"its chunks are whole and their CRCs match: the image data they hold does "
                                         r"not decode\)$"):
        images.decode(forged)

def test_decode_is_rgb_and_png_decodes_exactly(jpeg):
    import cv2

    image = images.decode(jpeg)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert images.image_size(jpeg) == image.shape[:2]
    ok, png = cv2.imencode(".png", np.ascontiguousarray(image[:, :, ::-1]))  # OpenCV writes BGR
    assert ok
    np.testing.assert_array_equal(images.decode(png.tobytes()), image)
    with pytest.raises(ValueError, match="are not an image that decodes"):
        images.decode(b"not an image at all")


def test_scaled_jpeg_decode_gives_the_full_decode_crop(jpeg, monkeypatch):
    """A large crop to a small size decodes at a reduced DCT scale (through libjpeg or, without it, simplejpeg); the
    crop matches resizing the same box of the full decode."""
    full = images.decode(jpeg)
    height, width = full.shape[:2]
    box = (10, 20, height - 30, width - 40)
    for crop_decoder in (images._crop_decoder, lambda: None):
        monkeypatch.setattr(images, "_crop_decoder", crop_decoder)
        scaled = images.decode_crop(jpeg, box, (32, 32))
        assert 32 <= scaled.shape[0] < box[2] // 2 and 32 <= scaled.shape[1] < box[3] // 2, scaled.shape
        reference = images._resize(full[10:height - 20, 20:width - 20], 32, 32)
        assert np.abs(images._resize(scaled, 32, 32).astype(int) - reference.astype(int)).mean() < 12
    out = images.random_resized_crop(jpeg, np.random.default_rng(0), 32, flip=False)
    top, left, h, w = images.sample_crop(np.random.default_rng(0), height, width)
    reference = images._resize(full[top:top + h, left:left + w], 32, 32)
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - reference.astype(int)).mean() < 12


def test_crop_window_decode_matches_the_whole_decode_and_the_fallback(jpeg, monkeypatch):
    """The libjpeg crop decode (loader/decoding/_jpeg.c) at full scale gives the box of the whole decode (up to
    libjpeg's smoothing across the box edge); at a reduced scale, close to the fallback path (simplejpeg, then cut)."""
    if images._crop_decoder() is None:
        pytest.skip("loader.decoding._jpeg was not built (no libjpeg headers at install): the simplejpeg path serves")
    full = images.decode(jpeg)
    height, width = full.shape[:2]
    rng = np.random.default_rng(1)
    for _ in range(20):
        top, left, h, w = images.sample_crop(rng, height, width)
        window = images.decode_crop(jpeg, (top, left, h, w), (h, w))
        assert window.shape == (h, w, 3)
        assert np.abs(window.astype(int) - full[top:top + h, left:left + w].astype(int)).mean() < 2
        small = images.decode_crop(jpeg, (top, left, h, w), (h // 4, w // 4))
        assert h // 4 <= small.shape[0] <= h and w // 4 <= small.shape[1] <= w
        with monkeypatch.context() as m:
            m.setattr(images, "_crop_decoder", lambda: None)
            fallback = images.decode_crop(jpeg, (top, left, h, w), (h // 4, w // 4))
        a, b = (images._resize(x, 32, 32).astype(int) for x in (small, fallback))
        assert np.abs(a - b).mean() < 10


def test_a_truncated_jpeg_is_an_error_not_grey_pixels(jpeg):
    with pytest.raises(ValueError, match="cut short|Premature end of JPEG file"):
        images.random_resized_crop(jpeg[:len(jpeg) // 2], np.random.default_rng(0), 32)


def _corrupted_mid_scan(jpeg: bytes) -> bytes:
    """`jpeg` with 32 bytes of its entropy-coded data, a third of the way into its scan, flipped."""
    start = jpeg.index(b"\xff\xda")  # start of scan
    at = start + (len(jpeg) - start) // 3
    return jpeg[:at] + bytes(b ^ 0x5A for b in jpeg[at:at + 32]) + jpeg[at + 32:]


def test_a_jpeg_corrupted_mid_scan_is_an_error_on_every_crop(jpeg, monkeypatch):
    """The whole decode warns at the end marker ("extraneous bytes"); the crop decode stopped at the crop's last row
    and returned wrong pixels without a word (17-41% of them, for crops through the damage). Now each crop, above,
    through or below the damage, is an error, as the whole decode is; an intact JPEG's crops are as they were."""
    bad = _corrupted_mid_scan(jpeg)
    with pytest.raises(ValueError, match="Corrupt JPEG data"):
        images.decode(bad)
    height, width = images.image_size(jpeg)
    boxes = [(0, 0, height // 8, width // 4), (height // 3, width // 4, height // 3, width // 2),
             (height - height // 8, 0, height // 8, width), (0, 0, height, width)]
    for crop_decoder in (images._crop_decoder, lambda: None):  # _jpeg.c's crop, simplejpeg's whole decode
        monkeypatch.setattr(images, "_crop_decoder", crop_decoder)
        for box in boxes:
            assert images.decode_crop(jpeg, box, (16, 16)).shape[2] == 3  # the intact one decodes
            with pytest.raises(ValueError, match="Corrupt JPEG data"):
                images.decode_crop(bad, box, (16, 16))
        with pytest.raises(ValueError, match="feature 'image': .*Corrupt JPEG data"):
            images.RandomResizedCrop("image", size=32)({"image": bad}, np.random.default_rng(0))
        with pytest.raises(ValueError, match="feature 'image': .*Corrupt JPEG data"):
            images.CenterCrop("image", size=32)({"image": bad})
        monkeypatch.undo()


def test_mutated_jpegs_crop_as_they_decode_whole():
    """600 JPEGs with 1-5 bytes of their scan changed, through loader/decoding/_jpeg.c: a crop is an error exactly
    when the whole image's decode is (corrupt data anywhere in the scan, the rows below the crop too), and where both
    decode, the crop's pixels are the whole decode's pixels of its box. (Changes libjpeg cannot tell from data decode
    in both, alike: JPEG has no checksum.)"""
    jpeg = images._crop_decoder()
    if jpeg is None:
        pytest.skip("loader/decoding/_jpeg.c was not built (no libjpeg headers at install)")
    from pipelines.demo import photo_jpegs

    rng = np.random.default_rng(0)
    bases = [j for j, _ in photo_jpegs(6, seed=3)]
    outcomes = collections.Counter()
    for case in range(600):
        base = bases[case % len(bases)]
        height, width = images.image_size(base)  # (the header comes before the scan: the changes leave it alone)
        data = bytearray(base)
        scan = data.index(b"\xff\xda")
        for _ in range(int(rng.integers(1, 6))):
            data[int(rng.integers(scan, len(data) - 2))] ^= int(rng.integers(1, 256))
        data = bytes(data)
        top, left = int(rng.integers(0, height // 2)), int(rng.integers(0, width // 2))
        h, w = int(rng.integers(8, height - top)), int(rng.integers(8, width - left))
        try:
            pixels, rows, cols, _, _ = jpeg.crop(data, 0, 0, height, width, height, width, 1 << 30)
            whole = np.frombuffer(pixels, np.uint8).reshape(rows, cols, 3)
        except ValueError:
            whole = None
        try:
            pixels, rows, cols, x_offset, n = jpeg.crop(data, top, left, h, w, h, w, 1 << 30)  # at full scale
            crop = np.frombuffer(pixels, np.uint8).reshape(rows, cols, 3)[:, x_offset:x_offset + w]
        except ValueError:
            crop = None
        if whole is None or crop is None:
            outcomes["both errors" if whole is None and crop is None else "one error"] += 1
        else:
            outcomes["equal" if np.array_equal(crop, whole[top:top + h, left:left + w]) else "unequal"] += 1
    assert set(outcomes) == {"both errors", "equal"} and min(outcomes.values()) > 100, outcomes


def test_an_empty_image_value_is_named_on_every_path(monkeypatch):
    """It was OpenCV's `(-215:Assertion failed) !buf.empty()`, naming neither the feature nor a fix."""
    said = re.escape("an empty value (0 bytes), not an image: the record holds no image in this feature")
    for crop_decoder in (images._crop_decoder, lambda: None):
        monkeypatch.setattr(images, "_crop_decoder", crop_decoder)
        with pytest.raises(ValueError, match=f"^feature 'image': {said}"):
            images.RandomResizedCrop("image", size=32)({"image": b""}, np.random.default_rng(0))
        with pytest.raises(ValueError, match=f"^feature 'image': {said}"):
            images.CenterCrop("image", size=32)({"image": b""})
        monkeypatch.undo()
    for call in (images.decode, images.image_size):
        with pytest.raises(ValueError, match=f"^{said}"):
            call(b"")


def test_the_committed_fuzz_images_are_the_tested_ones():
    committed = {p.name: p.stat().st_size for p in FUZZ_IMAGES.iterdir() if p.name != "README.md"}
    assert set(committed) == set(BOMBS) | set(DAMAGED) | set(WHOLE) == set(make_fuzz_images())
    assert max(committed.values()) < 50_000, committed
    readme = (FUZZ_IMAGES / "README.md").read_text()
    assert [name for name in committed if f"`{name}`" not in readme] == []


BOMB_CHILD = """
import json, sys
import numpy as np
from loader.decoding import images


def memory(field):  # VmRSS now, VmHWM the peak. (ru_maxrss starts at the parent's peak: Linux keeps it across exec.)
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))


data = open(sys.argv[1], "rb").read()
images.center_crop(open(sys.argv[2], "rb").read(), 32)  # load the decoders first: their pages are not the bomb's
crop_decoder = images._crop_decoder


def simplejpeg_crop():
    images._crop_decoder = lambda: None
    try:
        return images.decode_crop(data, (0, 0, 64, 64), (32, 32))
    finally:
        images._crop_decoder = crop_decoder


calls = {
    "decode": lambda: images.decode(data),
    "image_size": lambda: images.image_size(data),
    "RandomResizedCrop": lambda: images.RandomResizedCrop("image", size=32)({"image": data}, np.random.default_rng(0)),
    "CenterCrop": lambda: images.CenterCrop("image", size=32)({"image": data}),
    "decode_crop": lambda: images.decode_crop(data, (0, 0, 64, 64), (32, 32)),  # a JPEG: _jpeg.c's own check
    "decode_crop without loader.decoding._jpeg": simplejpeg_crop,
}
for name, call in calls.items():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here: the peak of this call alone
    before = memory("VmRSS")
    try:
        call()
        error = None
    except ValueError as e:
        error = str(e)
    grew = memory("VmHWM") - before
    print(json.dumps({"call": name, "error": error, "grew_mb": round(grew / 2**20)}), flush=True)
"""


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_decompression_bomb_is_refused_from_its_header(name):
    """A progressive JPEG's header declaring 30000x30000 (libjpeg would allocate its whole coefficient buffer, 5 GB, at
    jpeg_start_decompress, crop or not) and a valid 24 KB PNG of 192M pixels: refused on every path before they decode,
    the peak memory of a child process within 200 MB of what it held before each call."""
    proc = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(FUZZ_IMAGES / name), str(FUZZ_IMAGES / "cmyk.jpg")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(calls) == 6, proc.stdout
    expected = re.escape(BOMBS[name]).replace(",", ",?")  # loader/decoding/_jpeg.c writes the numbers without commas
    for call in calls:
        assert call["error"] is not None and re.search(rf"an image declaring {expected} \(a decompression bomb\?\); "
                                                       "pass a larger max_pixels=", call["error"]), call
        assert call["grew_mb"] < 200, call


def test_the_pixel_cap_is_an_option_of_the_image_ops(jpeg, monkeypatch):
    """max_pixels= on the ops and functions: an image of exactly that many pixels decodes on every path (a progressive
    4:4:4 JPEG too: libjpeg's memory limit, set from the cap, holds its coefficients), one pixel fewer is an error."""
    import cv2

    height, width = images.image_size(jpeg)
    pixels = height * width
    bgr = images.decode(jpeg)[:, :, ::-1]
    progressive = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1, cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
                                             cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444])[1].tobytes()
    png = cv2.imencode(".png", bgr)[1].tobytes()
    over = re.escape(f"an image declaring {height}x{width} = {pixels:,} pixels, over max_pixels={pixels - 1:,} "
                     "(a decompression bomb?)").replace(",", ",?")
    for data in (jpeg, progressive, png):
        record, rng = {"image": data}, np.random.default_rng(0)
        assert images.RandomResizedCrop("image", size=32, max_pixels=pixels)(record, rng)["image"].shape == (32, 32, 3)
        assert images.CenterCrop("image", size=32, max_pixels=pixels)(record)["image"].shape == (32, 32, 3)
        assert images.decode(data, max_pixels=pixels).shape == (height, width, 3)
        with pytest.raises(ValueError, match=f"feature 'image': {over}"):
            images.RandomResizedCrop("image", size=32, max_pixels=pixels - 1)(record, rng)
        with pytest.raises(ValueError, match=f"feature 'image': {over}"):
            images.CenterCrop("image", size=32, max_pixels=pixels - 1)(record)
        for call in (images.decode, images.image_size):
            with pytest.raises(ValueError, match=over):
                call(data, max_pixels=pixels - 1)
        for crop_decoder in (images._crop_decoder, lambda: None):  # _jpeg.c's whole-image crop, simplejpeg's
            monkeypatch.setattr(images, "_crop_decoder", crop_decoder)
            whole = images.decode_crop(data, (0, 0, height, width), (height, width), max_pixels=pixels)
            assert whole.shape == (height, width, 3)
            with pytest.raises(ValueError, match=over):
                images.decode_crop(data, (0, 0, height, width), (height, width), max_pixels=pixels - 1)
            monkeypatch.undo()
    for bad in (0, -1, 2.5, True):
        for op in (images.RandomResizedCrop, images.CenterCrop):
            with pytest.raises(ValueError, match=r"max_pixels must be a whole number of pixels >= 1 \(got "):
                op("image", max_pixels=bad)


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_a_damaged_image_is_an_error_on_every_decode_path(name, monkeypatch):
    """A JPEG (CMYK or RGB) or PNG cut short, or a JPEG whose scan stops short before its end marker: an error from
    loader/decoding/_jpeg.c, simplejpeg and OpenCV alike, never pixels padded with grey (OpenCV pads a JPEG it
    decodes)."""
    data = _fuzz(name)
    error = DAMAGED[name]
    whole = images.RandomResizedCrop("image", size=32, area_range=(1.0, 1.0))  # the whole image: every row decodes
    for crop_decoder in (images._crop_decoder, lambda: None):
        monkeypatch.setattr(images, "_crop_decoder", crop_decoder)
        with pytest.raises(ValueError, match=error):
            images.decode_crop(data, (0, 0, 256, 256), (32, 32))
        with pytest.raises(ValueError, match=f"feature 'image': .*{error}"):
            whole({"image": data}, np.random.default_rng(0))
        with pytest.raises(ValueError, match=f"feature 'image': .*{error}"):
            images.CenterCrop("image", size=32)({"image": data})
        monkeypatch.undo()
    with pytest.raises(ValueError, match=error):
        images.decode(data)


@pytest.mark.parametrize("kind", ["baseline", "progressive", "png"])
def test_an_image_with_a_trailer_decodes_on_every_path_as_without_it(kind, monkeypatch):
    """Data after a whole image's end marker (a phone's "motion photo" appends its video to the JPEG) made it "cut
    short" once over 1 KiB: one such photo stopped the run. The file's markers are walked to its end marker now; the
    same image cut short, with or without a trailer after the cut, is still refused."""
    import cv2
    from PIL import Image

    buffer = io.BytesIO()
    picture = Image.fromarray(_pattern(96, 128))
    if kind == "png":
        picture.save(buffer, "PNG")
    else:
        picture.save(buffer, "JPEG", quality=90, progressive=kind == "progressive")
    image = buffer.getvalue()
    trailer = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)).replace(b"\xd9", b"") * 20  # 5 KB, no FF D9
    assert len(trailer) > images.EOI_WITHIN and b"\xff\xd9" not in trailer and b"IEND" not in trailer
    box, size = (8, 16, 64, 80), (32, 32)
    for crop_decoder in (images._crop_decoder, lambda: None):
        monkeypatch.setattr(images, "_crop_decoder", crop_decoder)
        np.testing.assert_array_equal(images.decode(image + trailer), images.decode(image))
        np.testing.assert_array_equal(images.decode_crop(image + trailer, box, size),
                                      images.decode_crop(image, box, size))
        cut = image[:len(image) * 2 // 3]
        for damaged in (cut, cut + trailer):
            with pytest.raises(ValueError, match="the file was cut short|Premature end|Corrupt"):
                images.decode_crop(damaged, box, size)
        monkeypatch.undo()
    assert cv2.imdecode(np.frombuffer(image + trailer, np.uint8), cv2.IMREAD_COLOR).shape == (96, 128, 3)


def test_the_end_marker_walk_finds_every_cut_and_only_cuts():
    """The walk to a JPEG's or PNG's end marker, over every cut of real images (baseline, progressive, restart
    markers, PNG) and 3,000 mutated ones: a cut anywhere before the end marker is found, the whole image with any
    trailer is whole, and mutated bytes give an answer, never an exception, in time linear in the size."""
    import time

    from PIL import Image

    from pipelines.demo import photo_jpegs

    encoded = [j for j, _ in photo_jpegs(2, seed=4)]
    for options in ({"progressive": True}, {"restart_marker_blocks": 1}):
        buffer = io.BytesIO()
        Image.fromarray(_pattern(64, 96)).save(buffer, "JPEG", **options)
        encoded.append(buffer.getvalue())
    buffer = io.BytesIO()
    Image.fromarray(_pattern(64, 96)).save(buffer, "PNG")
    encoded.append(buffer.getvalue())
    rng = np.random.default_rng(0)
    for data in encoded:
        walk = images._png_reaches_its_end if data[:8] == images.PNG_MAGIC else images._jpeg_reaches_its_end
        assert walk(data) and walk(data + rng.bytes(3000))
        end_marker = 12 if walk is images._png_reaches_its_end else 2  # (IEND's length, type and CRC; FF D9)
        assert not any(walk(data[:cut]) for cut in range(len(data) - end_marker))
    started = time.monotonic()
    for case in range(3000):
        data = bytearray(encoded[case % len(encoded)])
        for _ in range(int(rng.integers(1, 8))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        cut = bytes(data[:int(rng.integers(2, len(data) + 1))])
        assert images._jpeg_reaches_its_end(cut) in (True, False) and images._png_reaches_its_end(cut) in (True, False)
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP"])
def test_an_exif_orientation_is_not_applied_and_crops_keep_their_shape(kind, monkeypatch):
    """OpenCV rotated a PNG by its EXIF orientation while its crop box came from the unrotated header: a 40x100
    PNG's central crop came out as an 87x15 strip stretched to a square. No orientation is applied, on any path (as
    TensorFlow decodes, and as JPEGs were already)."""
    from PIL import Image

    pixels = _pattern(48, 112)
    picture = Image.fromarray(pixels)
    exif = picture.getexif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    buffer = io.BytesIO()
    picture.save(buffer, kind, exif=exif.tobytes(), **({"lossless": True} if kind == "WEBP" else {}))
    data = buffer.getvalue()
    for crop_decoder in (images._crop_decoder, lambda: None):
        monkeypatch.setattr(images, "_crop_decoder", crop_decoder)
        decoded = images.decode(data)
        assert decoded.shape == (48, 112, 3) and images.image_size(data) == (48, 112)
        if kind != "JPEG":
            np.testing.assert_array_equal(decoded, pixels)
        rows, cols, _ = images.decode_crop(data, (8, 16, 32, 64), (16, 32)).shape  # (a JPEG's may decode scaled)
        assert cols == 2 * rows and rows >= 16
        assert images.CenterCrop("image", size=24)({"image": data})["image"].shape == (24, 24, 3)
        monkeypatch.undo()


@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_a_decoded_image_with_alpha_crops_as_its_png_does(mode):
    """A TFDS Image of 4 channels (or grey and alpha) arrives decoded where the trainer shapes its model from the first
    record: the crop refused it ("expected [H, W], [H, W, 1] or [H, W, 3]") and the run stopped, though its PNG bytes,
    what training reads, decode with the alpha dropped. The decoded array now crops as its PNG does."""
    from PIL import Image

    pixels = _pattern(48, 64)
    alpha = np.arange(48 * 64, dtype=np.uint8).reshape(48, 64, 1)
    array = np.concatenate([pixels if mode == "RGBA" else pixels[:, :, :1], alpha], axis=2)
    buffer = io.BytesIO()
    Image.fromarray(array, mode).save(buffer, "PNG")
    crop = images.CenterCrop("image", size=24)
    np.testing.assert_array_equal(crop({"image": array})["image"], crop({"image": buffer.getvalue()})["image"])
    np.testing.assert_array_equal(images.decode_crop(array, (4, 8, 32, 40), (32, 40)),
                                  images.decode_crop(buffer.getvalue(), (4, 8, 32, 40), (32, 40)))


def test_an_image_neither_jpeg_nor_png_decodes_once_a_crop(monkeypatch):
    """A WebP's (or BMP's) size takes its decode: the crop decoded it whole for its size, then again for the crop."""
    from PIL import Image

    pixels = _pattern(48, 64)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "WEBP", lossless=True)
    data = buffer.getvalue()
    cv2 = images._cv2()
    calls, imdecode = [], cv2.imdecode
    monkeypatch.setattr(cv2, "imdecode", lambda *a: calls.append(1) or imdecode(*a))
    crop = images.random_resized_crop(data, np.random.default_rng(0), 16)
    assert len(calls) == 1
    np.testing.assert_array_equal(crop, images.random_resized_crop(pixels, np.random.default_rng(0), 16))
    assert images.center_crop(data, 16).shape == (16, 16, 3) and len(calls) == 2


def test_a_cmyk_jpeg_decodes_on_every_path(monkeypatch):
    """A CMYK JPEG decodes through simplejpeg (loader/decoding/_jpeg.c leaves CMYK to it) to the RGB Pillow gives."""
    from PIL import Image

    data = _fuzz("cmyk.jpg")
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
    assert np.abs(images.decode(data).astype(int) - expected).mean() < 2
    for crop_decoder in (images._crop_decoder, lambda: None):
        monkeypatch.setattr(images, "_crop_decoder", crop_decoder)
        crop = images.decode_crop(data, (16, 32, 128, 160), (128, 160))
        assert np.abs(crop.astype(int) - expected[16:144, 32:192]).mean() < 2
        monkeypatch.undo()


def test_flip_mirrors_the_same_crop(jpeg):
    for index in range(8):
        flipped = images.random_resized_crop(jpeg, record_rng(0, 0, index), 48, flip=True)
        plain = images.random_resized_crop(jpeg, record_rng(0, 0, index), 48, flip=False)
        assert np.array_equal(flipped, plain) or np.array_equal(flipped, plain[:, ::-1])
    flips = [not np.array_equal(images.random_resized_crop(jpeg, record_rng(0, 0, i), 48),
                                images.random_resized_crop(jpeg, record_rng(0, 0, i), 48, flip=False))
             for i in range(40)]
    assert 8 < sum(flips) < 32


def test_center_crop_keeps_the_middle(jpeg):
    full = images.decode(jpeg)
    out = images.center_crop(jpeg, 64)
    assert out.shape == (64, 64, 3)
    # The same as resizing the full decode (short side to 64 / 0.875 = 73) and cropping its middle.
    height, width = full.shape[:2]
    scale = 73 / min(height, width)
    resized = images._resize(full, round(height * scale), round(width * scale))
    top, left = (resized.shape[0] - 64) // 2, (resized.shape[1] - 64) // 2
    assert np.abs(out.astype(int) - resized[top:top + 64, left:left + 64].astype(int)).mean() < 12
    np.testing.assert_array_equal(images.center_crop(full, 64).shape, (64, 64, 3))


def test_transforms_refuse_bad_settings():
    with pytest.raises(ValueError, match="size must be >= 1"):
        images.RandomResizedCrop("image", size=0)
    with pytest.raises(ValueError, match="area_range"):
        images.RandomResizedCrop("image", area_range=(0.5, 0.1))
    with pytest.raises(ValueError, match="crop_fraction"):
        images.CenterCrop("image", crop_fraction=1.5)
    with pytest.raises(ValueError, match="map_fn= or random_map_fn="):
        loader.load("unused", batch_size=1, map_fn=lambda r: r, random_map_fn=lambda r, g: r)


def _train(photos, **options):
    return loader.load(str(photos), batch_size=8, seed=2,
                       random_map_fn=images.RandomResizedCrop("image/encoded", size=32), **options)


def test_loader_crops_are_the_same_for_any_host_count_and_after_a_resume(photos):
    single = _take(iter(_train(photos)), 8)  # 64 rows: past the first epoch of 48
    assert single[0]["image"].shape == (8, 32, 32, 3) and single[0]["image"].dtype == np.uint8
    assert "image/encoded" not in single[0] and single[0]["image/class/label"].shape == (8,)
    # The second epoch crops the same records differently (the epoch is part of the seed).
    first_epoch = np.concatenate([b["image"] for b in single[:6]])
    second_epoch = np.concatenate([b["image"] for b in single[6:8]])
    assert not any(np.array_equal(second_epoch[0], image) for image in first_epoch)
    for hosts in (2, 4):
        parts = [_take(iter(_train(photos, shard_index=h, shard_count=hosts)), 8) for h in range(hosts)]
        for k in range(8):
            np.testing.assert_array_equal(np.concatenate([p[k]["image"] for p in parts]), single[k]["image"])
    it = iter(_train(photos))
    _take(it, 3)
    state = it.get_state()
    resumed = iter(_train(photos))
    resumed.set_state(state)
    for k, batch in enumerate(_take(resumed, 5)):
        np.testing.assert_array_equal(batch["image"], single[3 + k]["image"])


@pytest.mark.timeout(180)
def test_loader_crops_are_the_same_with_worker_processes(photos):
    single = _take(iter(_train(photos)), 4)
    workers = iter(_train(photos, worker_count=2))
    for k, batch in enumerate(_take(workers, 4)):
        np.testing.assert_array_equal(batch["image"], single[k]["image"])
        np.testing.assert_array_equal(batch["image/class/label"], single[k]["image/class/label"])
    workers.close()


def test_a_record_that_is_not_an_image_is_named(tmp_path, photos):
    from dataset_format import example_proto
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    records = [example_proto.encode_example({"image/encoded": b"\xff\xd8 truncated", "label": i}) for i in range(4)]
    write_tfrecord_shards(tmp_path / "in", [records])
    assert run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")),
                          ["--direct_num_workers=1"]).ok
    it = iter(loader.load(str(tmp_path / "out"), batch_size=2, shuffle=False,
                          random_map_fn=images.RandomResizedCrop("image/encoded", size=32)))
    with pytest.raises(ValueError, match=r"train-00000-of-00001\.array_record: record 0: RandomResizedCrop failed "
                                         r"\(ValueError: feature 'image/encoded': 12 bytes starting"):
        next(it)
    it = iter(loader.load(str(photos), batch_size=2, random_map_fn=images.RandomResizedCrop("jpeg", size=32)))
    with pytest.raises(ValueError, match=r"record \d+: RandomResizedCrop failed \(KeyError: .*no image feature "
                                         r"'jpeg'"):
        next(it)
    it = iter(loader.load(str(tmp_path / "out"), batch_size=2, shuffle=False,  # an int feature named as the image
                          random_map_fn=images.RandomResizedCrop("label", size=32)))
    with pytest.raises(ValueError, match=r"record 0: RandomResizedCrop failed \(ValueError: feature 'label' holds a "
                                         r"int64 array of shape \(\), not an image"):
        next(it)


def test_a_damaged_image_is_named_by_shard_record_and_feature(tmp_path):
    from dataset_format import example_proto
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    names = sorted(DAMAGED)
    write_tfrecord_shards(tmp_path / "in", [[example_proto.encode_example({"image/encoded": _fuzz(n), "label": i})
                                             for i, n in enumerate(names)]])
    assert run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")),
                          ["--direct_num_workers=1"]).ok
    options = dict(batch_size=1, shuffle=False,
                   random_map_fn=images.RandomResizedCrop("image/encoded", size=32, area_range=(1.0, 1.0)))
    start = iter(loader.load(str(tmp_path / "out"), **options)).get_state()
    for index, name in enumerate(names):
        it = iter(loader.load(str(tmp_path / "out"), **options))
        it.set_state({**start, "next_batch": index})
        with pytest.raises(ValueError, match=rf"train-00000-of-00001\.array_record: record {index}: RandomResizedCrop "
                                             rf"failed \(ValueError: feature 'image/encoded': .*{DAMAGED[name]}"):
            next(it)


OWNER = """
import os, sys, loader
from loader.decoding import images
if __name__ == "__main__":
    it = iter(loader.load(sys.argv[1], batch_size=8, worker_count=2,
                          random_map_fn=images.RandomResizedCrop("image/encoded", size=32)))
    next(it)
    print(os.getpid(), flush=True)
    sys.stdin.read()  # until killed
"""


@pytest.mark.timeout(180)
def test_workers_exit_when_their_owner_is_killed(photos, tmp_path):
    """SIGKILL of a process that owns a loader with 2 worker processes: within 15 s none of its children lives."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script), str(photos)], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children = []
    try:
        assert int(owner.stdout.readline()) == owner.pid
        children = psutil.Process(owner.pid).children(recursive=True)
        assert len(children) >= 2, children  # the two workers (and multiprocessing's resource tracker)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        deadline = time.monotonic() + 15
        alive = children
        while alive and time.monotonic() < deadline:
            alive = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.2)
        assert not alive, f"still alive 15 s after their owner was killed: {[c.cmdline()[:3] for c in alive]}"
    finally:  # only the owner's own processes: this test process has others (the session's GCS emulator)
        owner.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_image_ops_import_nothing_heavy():
    code = "import sys, loader.decoding.images; assert 'cv2' not in sys.modules and 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_bench_command_reports_images_per_second(photos, monkeypatch, capsys):
    from loader import cli

    monkeypatch.setattr(cli, "STEADY_SECONDS", 0.0)  # 3 batches: a real bench times a second or more
    assert cli.main(["bench", str(photos), "--image", "image/encoded", "--image_size", "32", "--batch_size", "8",
                     "--start", "2", "--batches", "3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"[\d,]+ images \(32x32 random-resized crops\)/s over 3 batches of 8", out), out
    bad = subprocess.run([sys.executable, "-m", "loader", "bench", str(photos), "--image", "jpeg", "--batch_size", "8",
                          "--start", "1", "--batches", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no image feature 'jpeg'" in bad.stderr, bad.stderr[-2000:]


def test_bench_finds_a_tfds_datasets_image_feature(tfds_digits_array_record, monkeypatch, capsys):
    """`--map images:SIZE` without --image looked for JPEG or PNG bytes in a record decoded through features.json,
    where a TFDS Image comes decoded: "no feature ... holds JPEG or PNG bytes". It takes the first Image feature."""
    from loader import cli

    monkeypatch.setattr(cli, "STEADY_SECONDS", 0.0)
    assert cli.main(["bench", str(tfds_digits_array_record), "--map", "images:16", "--batch_size", "8", "--start", "1",
                     "--batches", "2"]) == 0
    assert re.search(r"[\d,]+ images \(16x16 random-resized crops\)/s over 2 batches of 8", capsys.readouterr().out)


def test_tfds_image_features_stay_encoded_for_the_crop(tfds_digits_array_record):
    """A TFDS Image feature reaches RandomResizedCrop as its PNG bytes (TFDS does not decode it first), and the crops
    equal those of the decoded arrays TFDS would have given."""
    from loader.decoding.decode import TfdsDecoder

    crop = images.RandomResizedCrop("image", size=16)
    train = loader.load(str(tfds_digits_array_record), batch_size=8, seed=1, random_map_fn=crop)
    assert train._decoder._encoded == ("image",)  # the loader asked TFDS to leave the image encoded
    batch = next(iter(train))
    assert batch["image"].shape == (8, 16, 16, 3) and batch["label"].shape == (8,)
    raw = next(iter(loader.load(str(tfds_digits_array_record), batch_size=8, seed=1, decode=None)))
    encoded = TfdsDecoder(str(tfds_digits_array_record), encoded=("image",))(raw[0])["image"]
    assert bytes(encoded[:8]) == b"\x89PNG\r\n\x1a\n"
    decoded = [TfdsDecoder(str(tfds_digits_array_record))(r) for r in raw]
    assert decoded[0]["image"].shape == (8, 8, 1)
    plan = loader.load(str(tfds_digits_array_record), batch_size=8, seed=1).plan
    for row, (record, index) in enumerate(zip(decoded, plan.host_indices(0))):
        expected = crop(record, record_rng(1, 0, int(index)))["image"]
        np.testing.assert_array_equal(batch["image"][row], expected)


if __name__ == "__main__":  # python -m tests.loader.decoding.test_images: write the crafted files again
    FUZZ_IMAGES.mkdir(parents=True, exist_ok=True)
    for file_name, file_bytes in make_fuzz_images().items():
        (FUZZ_IMAGES / file_name).write_bytes(file_bytes)


@pytest.mark.parametrize("lib_version", [62, 80])
def test_the_crop_decoder_compiles_against_both_libjpeg_apis(tmp_path, lib_version):
    """libjpeg's API 7+ (libjpeg-turbo built --with-jpeg8, as CUDA images ship it) splits min_DCT_scaled_size in two:
    _jpeg.c compiles against both (where it does not build, images decode whole, ~2x the CPU a crop). Compiled
    against this machine's jpeglib.h with its jconfig.h's JPEG_LIB_VERSION set to 62 and to 80."""
    import sysconfig
    jpeglib = next((p for p in ("/usr/include/jpeglib.h", "/usr/local/include/jpeglib.h") if os.path.exists(p)), None)
    if jpeglib is None or not shutil.which("gcc"):
        pytest.skip("no jpeglib.h or gcc here: _jpeg.c is optional and not built")
    include = os.path.dirname(jpeglib)
    jconfig = next(p for p in [os.path.join(include, "jconfig.h"), *glob.glob(f"{include}/*/jconfig.h")]
                   if os.path.exists(p))
    text = re.sub(r"#define JPEG_LIB_VERSION\s+\d+", f"#define JPEG_LIB_VERSION {lib_version}", open(jconfig).read())
    assert f"JPEG_LIB_VERSION {lib_version}" in text, jconfig
    (tmp_path / "jconfig.h").write_text(text)
    for name in ("jpeglib.h", "jmorecfg.h"):
        shutil.copy(os.path.join(include, name), tmp_path / name)
    done = subprocess.run(["gcc", "-fsyntax-only", "-std=gnu11", "-Werror=implicit-function-declaration",
                           f"-I{tmp_path}", f"-I{sysconfig.get_paths()['include']}",
                           str(REPO / "loader/decoding/_jpeg.c")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_crop_op_says_once_when_crops_decode_whole_jpegs(monkeypatch, caplog):
    """Without _jpeg.c built, RandomResizedCrop still works (whole decodes) and says so once, with the fix."""
    monkeypatch.setattr(images, "_crop_decoder", lambda: None)
    images._say_if_crops_decode_whole.cache_clear()
    with caplog.at_level("INFO", logger=images.__name__):
        images.RandomResizedCrop("image/encoded", size=32)
        images.RandomResizedCrop("image/encoded", size=64)
    lines = [r.getMessage() for r in caplog.records if r.name == images.__name__]
    assert len(lines) == 1 and "not built" in lines[0] and "libjpeg-turbo8-dev" in lines[0], lines
    monkeypatch.undo()
    images._say_if_crops_decode_whole.cache_clear()
    caplog.clear()
    with caplog.at_level("INFO", logger=images.__name__):
        images.RandomResizedCrop("image/encoded", size=32)
    assert [r for r in caplog.records if r.name == images.__name__] == [] or images._crop_decoder() is None


def test_a_tfds_decoder_builds_its_features_once_when_threads_start_together(tfds_digits_array_record, monkeypatch):
    """The loader's threads decode a TFDS dataset's first records at once: one of them imports TFDS and builds the
    features, the others wait for it (each importing at once hung the loader in a lock of the import)."""
    import threading
    from loader.decoding import decode

    raw = next(iter(loader.load(str(tfds_digits_array_record), batch_size=8, seed=1, decode=None)))
    decoder = decode.TfdsDecoder(str(tfds_digits_array_record), encoded=("image",))
    builds, load = [], decode.TfdsDecoder._load_features

    def slow_load(self):
        builds.append(threading.get_ident())
        time.sleep(0.2)  # (a window for the other threads to enter)
        load(self)

    monkeypatch.setattr(decode.TfdsDecoder, "_load_features", slow_load)
    start, got = threading.Barrier(8), [None] * 8

    def decode_one(k):
        start.wait()
        got[k] = decoder(raw[k])

    threads = [threading.Thread(target=decode_one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(builds) == 1 and all(g is not None and bytes(g["image"][:8]) == images.PNG_MAGIC for g in got), builds


def _without_crop_decoder(op, *args):
    keep = images._crop_decoder
    images._crop_decoder = lambda: None
    try:
        return op(*args)
    finally:
        images._crop_decoder = keep


def test_crops_have_the_same_pixels_with_and_without_the_crop_decoder():
    """A host without _jpeg.c built augments alike: simplejpeg decodes at the scale _jpeg.c picks (1/2, 1/4, 1/8 only,
    not 3/8 .. 7/8) and cuts the box rounded as it does. 56% of these crops differed (up to 175 levels) before."""
    if images._crop_decoder() is None:
        pytest.skip("loader/decoding/_jpeg.c was not built: one path only")
    from pipelines.demo import photo_jpegs

    photos = [p for p, _ in photo_jpegs(12, seed=3)]
    compared = 0
    for size in (224, 96, 32):
        op = images.RandomResizedCrop("image", size=size)
        for k, photo in enumerate(photos):
            built = op({"image": photo}, np.random.default_rng(k))["image"]
            other = _without_crop_decoder(op, {"image": photo}, np.random.default_rng(k))["image"]
            assert built.shape == other.shape == (size, size, 3) and np.array_equal(built, other), (size, k)
            compared += 1
    assert compared == 36
    height, width = images.image_size(photos[0])
    assert images.decode(photos[0], min_height=height * 5 // 8, min_width=width * 5 // 8).shape == (height, width, 3)
    assert images.decode(photos[0], min_height=height // 3, min_width=width // 3).shape == (-(-height // 2),
                                                                                         -(-width // 2), 3)


def _jpeg_441(size=64):
    """A valid JPEG with luma sampled 1x4 (4:4:1: what a lossless 90-degree turn of a 4:1:1 JPEG gives)."""
    import simplejpeg

    data = bytearray(simplejpeg.encode_jpeg(np.random.default_rng(0).integers(0, 256, (size, size, 3), np.uint8),
                                            colorsubsampling="411"))
    data[data.index(b"\xff\xc0") + 11] = 0x14
    return bytes(data)


def test_a_jpeg_of_a_sampling_turbojpeg_does_not_name_decodes_through_libjpeg():
    """4:4:1 was `KeyError: 6` from simplejpeg's header call on every op (the feature unnamed); its size now comes from
    the frame header, and what TurboJPEG's whole decode refuses goes to _jpeg.c (or says why, where it is not built)."""
    data = _jpeg_441()
    assert images.image_size(data) == (64, 64)
    if images._crop_decoder() is None:
        with pytest.raises(ValueError, match=r"chroma sampling .* _jpeg\.c, which is not built here"):
            images.decode(data)
        return
    assert images.decode(data).shape == (64, 64, 3) and images.decode(data, min_height=16, min_width=16).shape == (
        16, 16, 3)
    assert images.RandomResizedCrop("image", size=32)({"image": data}, np.random.default_rng(0))["image"].shape == (
        32, 32, 3)
    assert images.CenterCrop("image", size=32)({"image": data})["image"].shape == (32, 32, 3)
    whole = images.decode(data)
    assert np.array_equal(images.decode_crop(data, (0, 0, 64, 64), (64, 64)), whole)
    with pytest.raises(ValueError, match=r"a JPEG declaring 0x64 pixels \(a height defined later by a DNL marker"):
        sof = data.index(b"\xff\xc0")
        images.decode(data[:sof + 5] + b"\x00\x00" + data[sof + 7:])


def _scans(count: int) -> bytes:
    """A progressive 1024x1024 JPEG and `count` more AC scans of 12 bytes, each ending every block's band at once (an
    EOB run of 16,384 blocks): libjpeg takes them without a warning, and each walks every block again."""
    import cv2

    base = cv2.imencode(".jpg", np.full((1024, 1024, 3), 128, np.uint8), [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1]
    table = b"\xff\xc4\x00\x14\x11" + bytes([1] + [0] * 15) + b"\xe0"  # AC table 1: one code, EOB14
    scan = b"\xff\xda\x00\x08\x01\x01\x01\x01\x3f\x00\x00\x01"
    return base.tobytes()[:-2] + table + scan * count + b"\xff\xd9"


def test_a_jpeg_of_too_many_scans_is_refused_on_both_paths():
    """4,000 scans of 40 bytes cost 12 s of CPU a crop (each scan decodes every block again); over MAX_SCANS (200) a
    JPEG is an error at once on both paths, and 150 extra scans still decode."""
    op = images.RandomResizedCrop("image", size=64)
    for run in (lambda r: r(), lambda r: _without_crop_decoder(r)):
        assert run(lambda: op({"image": _scans(150)}, np.random.default_rng(0)))["image"].shape == (64, 64, 3)
        started = time.process_time()
        with pytest.raises(ValueError, match=r"feature 'image': .*not a JPEG that decodes.*more than 200 scans \(a "
                                             r"progressive JPEG has ~10"):
            run(lambda: op({"image": _scans(400)}, np.random.default_rng(0)))
        assert time.process_time() - started < 2


def test_crops_are_writeable_copies_and_arrays_come_to_uint8():
    """A crop at the output size was a read-only view of the decoder's bytes (CenterCrop(224) of a 256x256 JPEG), or
    of the caller's array; uint16 pixels came out uint16, other dtypes failed inside OpenCV."""
    import cv2

    data = cv2.imencode(".jpg", np.random.default_rng(0).integers(0, 256, (256, 256, 3), np.uint8))[1].tobytes()
    out = images.CenterCrop("image", size=224)({"image": data})["image"]
    assert out.flags.writeable and out.shape == (224, 224, 3)
    pixels = np.random.default_rng(1).integers(0, 256, (40, 40, 3), np.uint8)
    out = images.CenterCrop("image", size=35)({"image": pixels})["image"]
    assert out.flags.writeable and not np.shares_memory(out, pixels)
    wide = pixels.astype(np.uint16) << 8 | 0xAB
    assert np.array_equal(images.CenterCrop("image", size=35)({"image": wide})["image"], out)
    with pytest.raises(ValueError, match=r"feature 'image': a decoded image of dtype float32: the image ops take uint8 "
                                         r"pixels \(or uint16, taken to 8 bits\); convert it first"):
        images.CenterCrop("image", size=35)({"image": pixels.astype(np.float32)})
