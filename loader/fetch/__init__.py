"""Getting records' bytes: the batch reader (reader), gs:// range reads (remote, host_limit), the chunk caches
(chunk_cache, planned_cache, disk_cache) and copying a remote dataset to local disk (staging). It builds on the format
(loader/format) only."""
