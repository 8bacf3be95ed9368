"""loader.images and random_map_fn: decode, crops, per-record randomness through the loader, bad images."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import loader
from loader import images
from loader.batches import record_rng
from tests.conftest import REPO

# Pinned: a change to the crop sampling or to the per-record seeding fails here loudly.
BOXES_375x500_SEED_0_EPOCH_0 = [(35, 302, 171, 129), (47, 118, 314, 295), (11, 112, 357, 343), (7, 72, 256, 335)]


@pytest.fixture(scope="session")
def photos(tmp_path_factory):
    """48 ImageNet-layout JPEG records (real photos) in 3 TFRecord shards, converted by the real pipeline."""
    from pipelines import ConvertConfig, run_conversion
    from pipelines.demo import write_photo_tfrecords

    root = tmp_path_factory.mktemp("photos")
    write_photo_tfrecords(str(root / "in"), 48, num_shards=3)
    assert run_conversion(ConvertConfig(input=str(root / "in" / "*"), output=str(root / "out")),
                          ["--direct_num_workers=1"]).ok
    return root / "out"


@pytest.fixture(scope="session")
def jpeg():
    from pipelines.demo import photo_jpegs

    return photo_jpegs(1, seed=5)[0][0]


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


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
    """The libjpeg crop decode (loader/_jpeg.c) at full scale gives the box of the whole decode (up to libjpeg's
    smoothing across the box edge); at a reduced scale, close to the fallback path (simplejpeg, then cut)."""
    if images._crop_decoder() is None:
        pytest.skip("loader._jpeg was not built (no libjpeg headers at install): the simplejpeg path serves")
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


OWNER = """
import os, sys, loader
from loader import images
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
    code = "import sys, loader.images; assert 'cv2' not in sys.modules and 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_bench_command_reports_images_per_second(photos):
    proc = subprocess.run([sys.executable, "-m", "loader", "bench", str(photos), "--image", "image/encoded",
                           "--image_size", "32", "--batch_size", "8", "--start", "2", "--batches", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"[\d,]+ images \(32x32 random-resized crops\)/s over 3 batches of 8", proc.stdout), proc.stdout
    bad = subprocess.run([sys.executable, "-m", "loader", "bench", str(photos), "--image", "jpeg", "--batch_size", "8",
                          "--start", "1", "--batches", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no image feature 'jpeg'" in bad.stderr, bad.stderr[-2000:]


def test_tfds_image_features_stay_encoded_for_the_crop(tfds_digits_array_record):
    """A TFDS Image feature reaches RandomResizedCrop as its PNG bytes (TFDS does not decode it first), and the crops
    equal those of the decoded arrays TFDS would have given."""
    from loader.decode import TfdsDecoder

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
