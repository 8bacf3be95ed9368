import os, sys, time
sys.path.insert(0, ".."); sys.path.insert(0, ".")
from pathlib import Path
import tempfile, numpy as np
from tests import emulator
import gcs_read_bench
root = Path(tempfile.mkdtemp()); (root / "g").mkdir()
with emulator.running(root / "g") as env:
    front = gcs_read_bench.Front(env["STORAGE_EMULATOR_HOST"])
    os.environ["STORAGE_EMULATOR_HOST"] = front.url
    os.environ["LOADER_INDEX_DIR"] = str(root / "idx")
    from google.cloud import storage
    c = storage.Client(project="test"); c.create_bucket("b")
    (root / "l").mkdir()
    paths = gcs_read_bench.write_shards(root / "l", 100_000, int(96e6))
    for p in paths: c.bucket("b").blob(f"d/{p.name}").upload_from_filename(str(p))
    front.call("config", {"files": {f"b/d/{p.name}": str(p) for p in paths}, "latency": 0.02, "bandwidth": 400e6})
    import loader
    for rep in range(2):
        ld = loader.load("gs://b/d/*.array_record", batch_size=32, seed=rep, decode=None, num_epochs=1)
        it = iter(ld)
        t, c0 = time.perf_counter(), time.process_time()
        n = sum(len(b) for b in it)
        w, cp = time.perf_counter() - t, time.process_time() - c0
        print(f"{n} records {n/w:.0f}/s, cpu {cp/n*1e3:.3f} ms/record")
        print(it.stage_times().report())
    front.close()
