/* Reading records of ArrayRecord files (riegeli/records, one record per chunk) in C, the GIL released.

   The byte layout (riegeli's doc/riegeli_records_file_format.md; array_record's cpp/layout.proto):
   - The file is cut into 64 KiB blocks; each block starts with a 24-byte block header that may fall anywhere,
     even inside a chunk header. Dropping the bytes at positions p with p % 65536 < 24 leaves the chunks end to end.
   - A chunk: a 40-byte header (header_hash, data_size, data_hash, chunk_type | num_records << 8,
     decoded_data_size; little-endian u64s), then data_size bytes of data, then padding.
     header_hash = HighwayHash-64 of header bytes 8..40, data_hash = HighwayHash-64 of the data, keyed with
     'Riegeli/records\n' twice.
   - A simple chunk ('r'): compression byte (0, 's' snappy, 'z' zstd, 'b' brotli), varint size of the sizes blob,
     the sizes blob (one varint per record), then the values blob (the records end to end). A compressed blob is a
     varint of its decompressed size followed by a raw snappy stream or a zstd frame.

   Exported (all buffers are C-contiguous; the loader passes NumPy arrays):
   - ef_encode(values, sample): the Elias-Fano code of a shard's chunk offsets (the compact index, index.py);
     locate(index, info, shards, locals, begins_out, ends_out): file spans of records from that index.
   - read(fds, begins, ends, check, max_gap, max_record): the records of those chunks, coalescing nearby chunks of a
     file into one pread; a list of bytes in the order given. A record over max_record bytes raises TooLargeError.
   - decode(spans, span_begins, fds-free records...): the same over spans already in memory (gs:// range reads).
   - plan_spans(fds, begins, ends, max_gap, span_of, waste): the coalesced spans read() would read, for remote reads
     (waste: at most that many percent more bytes than the records hold).
   - decode_chunk(data, position, check, max_records): a whole simple chunk of any number of records -> (sizes
     bytes, values bytes) (the footer); footer_offsets(sizes, values, footer_offset, group): its entries' chunk
     offsets and record counts, checked.
   - stat_paths(paths, ...): many files' sizes, modification and change times and inodes, stat(2) on several threads.
   - buffers_kept(), zstd_contexts(): read buffers and zstd contexts that threads keep now (each is freed when its
     thread ends).
   - hash64(data, portable=False): HighwayHash-64 with riegeli's key (tests); HASH_AVX2: whether AVX2 computes it.
   Errors carry the position of the record (in the order given) that failed: the Python side names the shard.
   zstd comes from the system's libzstd.so.1, opened on first use; snappy is decoded here.

   Every length read from a file is untrusted (a crafted file can carry any value with valid hashes: HighwayHash's key
   is public). Each one passes `fits(p, end, n)` (n <= end - p, which cannot wrap) before it is used, and every
   allocation is bounded before it is made: a record by the bytes its codec can produce from the chunk's stored bytes
   and by the caller's max_record, a footer's record count by the bytes that hold its sizes, its decoded bytes by
   the record count. A chunk must end where its span ends (or be followed by riegeli padding that does). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BLOCK_SIZE 65536
#define BLOCK_HEADER_SIZE 24
#define CHUNK_HEADER_SIZE 40
#define SIMPLE_CHUNK 'r'

static PyObject *CorruptError;   /* a hash, size or structure check failed: the file is damaged */
static PyObject *TooLargeError;  /* a record over the caller's max_record: args (why, record, its size) */
static PyObject *UnsupportedError; /* a chunk this reader does not decode (the caller falls back) */

/* ------------------------------------------------------------------------------------------------ */
/* HighwayHash-64, portable form, with riegeli's key.                                                */

typedef struct {
  uint64_t v0[4], v1[4], mul0[4], mul1[4];
} hh_state;

static const uint64_t RIEGELI_KEY[4] = {0x2f696c6567656952ULL, 0x0a7364726f636572ULL, 0x2f696c6567656952ULL,
                                        0x0a7364726f636572ULL};
static const uint64_t HH_INIT0[4] = {0xdbe6d5d5fe4cce2fULL, 0xa4093822299f31d0ULL, 0x13198a2e03707344ULL,
                                     0x243f6a8885a308d3ULL};
static const uint64_t HH_INIT1[4] = {0x3bd39e10cb0ef593ULL, 0xc0acf169b5f18a8cULL, 0xbe5466cf34e90c6cULL,
                                     0x452821e638d01377ULL};

static inline uint64_t load64(const uint8_t *p) {
  uint64_t x;
  memcpy(&x, p, 8);
  return x; /* little-endian hosts only (x86-64, aarch64): checked at import */
}

static inline uint64_t swap_halves(uint64_t x) { return (x >> 32) | (x << 32); }

/* Byte `from` of `x` moved to byte `to` of the result. */
#define MOVE(x, from, to) ((((x) >> (8 * (from))) & 0xffULL) << (8 * (to)))

/* The "zipper merge": the 16 bytes of (lo, hi) reordered by the table
   lo' = lo[3] hi[4] lo[2] lo[5] hi[6] lo[1] hi[7] lo[0],  hi' = hi[3] lo[4] hi[2] hi[5] hi[1] lo[6] hi[0] lo[7]
   and added to (add_lo, add_hi). */
static inline void zipper_add(uint64_t hi, uint64_t lo, uint64_t *add_hi, uint64_t *add_lo) {
  *add_lo += MOVE(lo, 3, 0) | MOVE(hi, 4, 1) | MOVE(lo, 2, 2) | MOVE(lo, 5, 3) | MOVE(hi, 6, 4) | MOVE(lo, 1, 5) |
             MOVE(hi, 7, 6) | MOVE(lo, 0, 7);
  *add_hi += MOVE(hi, 3, 0) | MOVE(lo, 4, 1) | MOVE(hi, 2, 2) | MOVE(hi, 5, 3) | MOVE(hi, 1, 4) | MOVE(lo, 6, 5) |
             MOVE(hi, 0, 6) | MOVE(lo, 7, 7);
}

static inline void hh_update(hh_state *s, const uint64_t lanes[4]) {
  for (int i = 0; i < 4; i++) {
    s->v1[i] += s->mul0[i] + lanes[i];
    s->mul0[i] ^= (s->v1[i] & 0xffffffffULL) * (s->v0[i] >> 32);
    s->v0[i] += s->mul1[i];
    s->mul1[i] ^= (s->v0[i] & 0xffffffffULL) * (s->v1[i] >> 32);
  }
  zipper_add(s->v1[1], s->v1[0], &s->v0[1], &s->v0[0]);
  zipper_add(s->v1[3], s->v1[2], &s->v0[3], &s->v0[2]);
  zipper_add(s->v0[1], s->v0[0], &s->v1[1], &s->v1[0]);
  zipper_add(s->v0[3], s->v0[2], &s->v1[3], &s->v1[2]);
}

static inline void hh_packet(hh_state *s, const uint8_t *p) {
  uint64_t lanes[4] = {load64(p), load64(p + 8), load64(p + 16), load64(p + 24)};
  hh_update(s, lanes);
}

static inline uint32_t rotl32(uint32_t x, unsigned n) { return n ? (x << n) | (x >> (32 - n)) : x; }

/* The last 1..31 bytes: their count is folded into the state, then they form one zero-padded packet (whole
   4-byte words first; of a tail of 1-3 bytes, its first, middle and last byte at 16..18; with 16 or more bytes,
   the last 4 bytes of the input at 28..31). */
static void hh_tail_packet(const uint8_t *bytes, size_t n, uint8_t packet[32]) {
  size_t words = n & ~(size_t)3, tail = n & 3;
  memset(packet, 0, 32);
  memcpy(packet, bytes, words);
  if (n & 16) {
    memcpy(packet + 28, bytes + n - 4, 4);
  } else if (tail) {
    packet[16] = bytes[words];
    packet[17] = bytes[words + (tail >> 1)];
    packet[18] = bytes[words + tail - 1];
  }
}

static void hh_remainder(hh_state *s, const uint8_t *bytes, size_t n) {
  uint8_t packet[32];
  for (int i = 0; i < 4; i++) {
    s->v0[i] += ((uint64_t)n << 32) + n;
    uint32_t lo = (uint32_t)s->v1[i], hi = (uint32_t)(s->v1[i] >> 32);
    s->v1[i] = (uint64_t)rotl32(lo, (unsigned)n) | ((uint64_t)rotl32(hi, (unsigned)n) << 32);
  }
  hh_tail_packet(bytes, n, packet);
  hh_packet(s, packet);
}

static uint64_t highway_hash64_portable(const uint8_t *data, size_t n) {
  hh_state s;
  for (int i = 0; i < 4; i++) {
    s.mul0[i] = HH_INIT0[i];
    s.mul1[i] = HH_INIT1[i];
    s.v0[i] = HH_INIT0[i] ^ RIEGELI_KEY[i];
    s.v1[i] = HH_INIT1[i] ^ swap_halves(RIEGELI_KEY[i]);
  }
  size_t i = 0;
  for (; i + 32 <= n; i += 32) hh_packet(&s, data + i);
  if (n & 31) hh_remainder(&s, data + i, n & 31);
  for (int round = 0; round < 4; round++) {
    uint64_t permuted[4] = {swap_halves(s.v0[2]), swap_halves(s.v0[3]), swap_halves(s.v0[0]),
                            swap_halves(s.v0[1])};
    hh_update(&s, permuted);
  }
  return s.v0[0] + s.v1[0] + s.mul0[0] + s.mul1[0];
}

/* The same hash with AVX2 (x86-64 CPUs since 2013): the four lanes in one register, the zipper merge one byte
   shuffle (HighwayHash's own AVX2 form). ~8x the portable form on 1 KB records; chosen at import when the CPU has
   AVX2 (hash64(data, portable=True) forces the portable form: the tests compare both). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HH_HAVE_AVX2 1

typedef struct {
  __m256i v0, v1, mul0, mul1;
} hh_avx2;

__attribute__((target("avx2"))) static inline void hh_avx2_update(hh_avx2 *s, __m256i packet) {
  const __m256i zipper = _mm256_set_epi64x(0x070806090D0A040BLL, 0x000F010E05020C03LL, 0x070806090D0A040BLL,
                                           0x000F010E05020C03LL);
  s->v1 = _mm256_add_epi64(s->v1, _mm256_add_epi64(s->mul0, packet));
  s->mul0 = _mm256_xor_si256(s->mul0, _mm256_mul_epu32(s->v1, _mm256_srli_epi64(s->v0, 32)));
  s->v0 = _mm256_add_epi64(s->v0, s->mul1);
  s->mul1 = _mm256_xor_si256(s->mul1, _mm256_mul_epu32(s->v0, _mm256_srli_epi64(s->v1, 32)));
  s->v0 = _mm256_add_epi64(s->v0, _mm256_shuffle_epi8(s->v1, zipper));
  s->v1 = _mm256_add_epi64(s->v1, _mm256_shuffle_epi8(s->v0, zipper));
}

__attribute__((target("avx2"))) static uint64_t highway_hash64_avx2(const uint8_t *data, size_t n) {
  const __m256i key = _mm256_loadu_si256((const __m256i *)RIEGELI_KEY);
  hh_avx2 s;
  s.mul0 = _mm256_loadu_si256((const __m256i *)HH_INIT0);
  s.mul1 = _mm256_loadu_si256((const __m256i *)HH_INIT1);
  s.v0 = _mm256_xor_si256(s.mul0, key);
  s.v1 = _mm256_xor_si256(s.mul1, _mm256_shuffle_epi32(key, _MM_SHUFFLE(2, 3, 0, 1)));
  size_t i = 0;
  for (; i + 32 <= n; i += 32) hh_avx2_update(&s, _mm256_loadu_si256((const __m256i *)(data + i)));
  size_t r = n & 31;
  if (r) {
    uint8_t packet[32];
    s.v0 = _mm256_add_epi64(s.v0, _mm256_set1_epi64x((long long)((r << 32) + r)));
    const __m128i left = _mm_cvtsi32_si128((int)r), right = _mm_cvtsi32_si128((int)(32 - r));
    s.v1 = _mm256_or_si256(_mm256_sll_epi32(s.v1, left), _mm256_srl_epi32(s.v1, right));
    hh_tail_packet(data + i, r, packet);
    hh_avx2_update(&s, _mm256_loadu_si256((const __m256i *)packet));
  }
  for (int round = 0; round < 4; round++) {
    __m256i permuted = _mm256_permute4x64_epi64(s.v0, _MM_SHUFFLE(1, 0, 3, 2));
    hh_avx2_update(&s, _mm256_shuffle_epi32(permuted, _MM_SHUFFLE(2, 3, 0, 1)));
  }
  __m256i sum = _mm256_add_epi64(_mm256_add_epi64(s.v0, s.v1), _mm256_add_epi64(s.mul0, s.mul1));
  return (uint64_t)_mm_cvtsi128_si64(_mm256_castsi256_si128(sum));
}
#endif

static int use_avx2; /* set at import from the CPU's features */

static inline uint64_t highway_hash64(const uint8_t *data, size_t n) {
#ifdef HH_HAVE_AVX2
  if (use_avx2) return highway_hash64_avx2(data, n);
#endif
  return highway_hash64_portable(data, n);
}

/* ------------------------------------------------------------------------------------------------ */
/* Varints, snappy, zstd.                                                                           */

/* Whether n bytes are left at p before end (p <= end). The only form of a bounds check here: p + n <= end wraps. */
static inline int fits(const uint8_t *p, const uint8_t *end, uint64_t n) { return n <= (uint64_t)(end - p); }

/* Reads a varint64 at *p (< end); 0 on success. */
static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (*p >= end) return -1;
    uint8_t b = *(*p)++;
    v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *out = v;
      return 0;
    }
  }
  return -1;
}

/* A raw snappy stream (its own varint length, then literals and copies) into exactly dst_len bytes. */
static int snappy_decode(const uint8_t *src, size_t n, uint8_t *dst, size_t dst_len) {
  const uint8_t *p = src, *end = src + n;
  uint64_t length;
  if (read_varint(&p, end, &length) || length != dst_len) return -1;
  size_t out = 0;
  while (p < end) {
    uint8_t tag = *p++;
    size_t len, offset;
    switch (tag & 3) {
      case 0: /* literal */
        len = tag >> 2;
        if (len >= 60) {
          size_t bytes = len - 59;
          if ((size_t)(end - p) < bytes) return -1;
          len = 0;
          for (size_t i = 0; i < bytes; i++) len |= (size_t)p[i] << (8 * i);
          p += bytes;
        }
        len += 1;
        if ((size_t)(end - p) < len || dst_len - out < len) return -1;
        memcpy(dst + out, p, len);
        p += len;
        out += len;
        continue;
      case 1: /* copy, 11-bit offset */
        if (p >= end) return -1;
        len = ((tag >> 2) & 7) + 4;
        offset = ((size_t)(tag >> 5) << 8) | *p++;
        break;
      case 2: /* copy, 16-bit offset */
        if (end - p < 2) return -1;
        len = (tag >> 2) + 1;
        offset = (size_t)p[0] | ((size_t)p[1] << 8);
        p += 2;
        break;
      default: /* copy, 32-bit offset */
        if (end - p < 4) return -1;
        len = (tag >> 2) + 1;
        offset = (size_t)p[0] | ((size_t)p[1] << 8) | ((size_t)p[2] << 16) | ((size_t)p[3] << 24);
        p += 4;
        break;
    }
    if (offset == 0 || offset > out || dst_len - out < len) return -1;
    uint8_t *d = dst + out;
    const uint8_t *s = d - offset;
    if (offset >= len) {
      memcpy(d, s, len);
    } else {
      for (size_t i = 0; i < len; i++) d[i] = s[i]; /* overlapping: a repeated pattern */
    }
    out += len;
  }
  return out == dst_len ? 0 : -1;
}

typedef void *(*zstd_create_fn)(void);
typedef size_t (*zstd_decompress_fn)(void *, void *, size_t, const void *, size_t);
typedef unsigned (*zstd_is_error_fn)(size_t);
typedef unsigned long long (*zstd_content_size_fn)(const void *, size_t);
typedef size_t (*zstd_free_fn)(void *);
static zstd_create_fn zstd_create;
static zstd_decompress_fn zstd_decompress;
static zstd_is_error_fn zstd_is_error;
static zstd_content_size_fn zstd_content_size;
static zstd_free_fn zstd_free;
#define ZSTD_CONTENT_UNKNOWN (0ULL - 1)
static __thread void *zstd_context; /* one decompression context per thread, kept; freed when the thread ends */
static pthread_key_t zstd_key;
static int64_t zstd_contexts;       /* contexts alive now (tests: none outlives its thread) */

static void zstd_release(void *context) {
  zstd_free(context);
  __atomic_fetch_sub(&zstd_contexts, 1, __ATOMIC_RELAXED);
}

/* Called with the GIL held, at import. */
static int zstd_load(void) {
  void *lib = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return -1;
  zstd_create = (zstd_create_fn)dlsym(lib, "ZSTD_createDCtx");
  zstd_decompress = (zstd_decompress_fn)dlsym(lib, "ZSTD_decompressDCtx");
  zstd_is_error = (zstd_is_error_fn)dlsym(lib, "ZSTD_isError");
  zstd_content_size = (zstd_content_size_fn)dlsym(lib, "ZSTD_getFrameContentSize");
  zstd_free = (zstd_free_fn)dlsym(lib, "ZSTD_freeDCtx");
  if (!(zstd_create && zstd_decompress && zstd_is_error && zstd_content_size && zstd_free)) {
    zstd_decompress = NULL;
    return -1;
  }
  return pthread_key_create(&zstd_key, zstd_release) ? (zstd_decompress = NULL, -1) : 0;
}

static void *zstd_thread_context(void) {
  if (!zstd_context && (zstd_context = zstd_create())) {
    __atomic_fetch_add(&zstd_contexts, 1, __ATOMIC_RELAXED);
    pthread_setspecific(zstd_key, zstd_context);
  }
  return zstd_context;
}

enum { OK = 0, CORRUPT = 1, UNSUPPORTED = 2, NO_MEMORY = 3, IO_ERROR = 4, TOO_LARGE = 5 };

/* Whether a blob of n stored bytes in `compression` can decode to `size` bytes; why not in *why. Checked before the
   output is allocated. Uncompressed: exactly n. Snappy: a 3-byte copy gives at most 64 bytes (< 22 a byte). zstd: the
   size its frame header declares, when it declares one (riegeli's writer always does). */
static int blob_can_hold(uint8_t compression, const uint8_t *src, size_t n, uint64_t size, const char **why) {
  const uint8_t *p = src, *end = src + n;
  uint64_t declared;
  if (compression == 0) return size == n ? OK : (*why = "an uncompressed blob of the wrong size", CORRUPT);
  if (read_varint(&p, end, &declared) || declared != size)
    return *why = "a compressed blob whose size disagrees with the chunk header", CORRUPT;
  if (compression == 's')
    return size / 22 <= (uint64_t)(end - p) ? OK : (*why = "more bytes than a snappy stream can hold", CORRUPT);
  if (compression == 'z') {
    if (!zstd_decompress) return *why = "zstd chunks need libzstd.so.1", UNSUPPORTED;
    if (size == 0 && p == end) return OK;
    unsigned long long frame = zstd_content_size(p, (size_t)(end - p));
    if (frame != ZSTD_CONTENT_UNKNOWN && frame != size)
      return *why = "a zstd frame whose size disagrees with the chunk header", CORRUPT;
    return OK;
  }
  return *why = (compression == 'b' ? "brotli chunks are not decoded here" : "an unknown compression type"),
         compression == 'b' ? UNSUPPORTED : CORRUPT;
}

/* A compressed blob (riegeli's varint of the decompressed size, then the stream) into exactly dst_len bytes. */
static int decompress_blob(uint8_t compression, const uint8_t *src, size_t n, uint8_t *dst, size_t dst_len,
                           const char **why) {
  const uint8_t *p = src, *end = src + n;
  uint64_t size;
  if (compression == 0) {
    if (n != dst_len) return *why = "an uncompressed blob of the wrong size", CORRUPT;
    memcpy(dst, src, n);
    return OK;
  }
  if (read_varint(&p, end, &size) || size != dst_len)
    return *why = "a compressed blob whose size disagrees with the chunk header", CORRUPT;
  if (compression == 's') {
    return snappy_decode(p, (size_t)(end - p), dst, dst_len) ? (*why = "a snappy stream that does not decode",
                                                                 CORRUPT)
                                                               : OK;
  }
  if (compression == 'z') {
    if (!zstd_decompress) return *why = "zstd chunks need libzstd.so.1", UNSUPPORTED;
    void *context = zstd_thread_context();
    if (!context) return *why = "out of memory", NO_MEMORY;
    if (dst_len == 0 && end == p) return OK;
    size_t got = zstd_decompress(context, dst, dst_len, p, (size_t)(end - p));
    if (zstd_is_error(got) || got != dst_len) return *why = "a zstd frame that does not decode", CORRUPT;
    return OK;
  }
  return *why = (compression == 'b' ? "brotli chunks are not decoded here" : "an unknown compression type"),
         compression == 'b' ? UNSUPPORTED : CORRUPT;
}

/* ------------------------------------------------------------------------------------------------ */
/* Chunks.                                                                                          */

typedef struct {
  const uint8_t *data; /* the chunk's data (after its header), block headers already removed */
  uint64_t data_size, num_records, decoded_size;
  uint8_t type;
  /* a one-record simple chunk, once checked (check_single): */
  uint8_t compression;
  const uint8_t *values;
  size_t values_len;
} chunk;

#define PADDING_CHUNK 'p'

/* Parses and checks the chunk at the start of `bytes` (n bytes, block headers removed). With `exact`, the n bytes
   are the chunk's whole span: it must fill them, alone or followed by one riegeli padding chunk that fills the rest
   (files written with pad_to_block_boundary:true). */
static int parse_chunk(const uint8_t *bytes, size_t n, int check, int exact, chunk *c, const char **why) {
  if (n < CHUNK_HEADER_SIZE) return *why = "a chunk shorter than its header (truncated file?)", CORRUPT;
  if (check && highway_hash64(bytes + 8, 32) != load64(bytes))
    return *why = "a chunk header whose hash does not match", CORRUPT;
  c->data_size = load64(bytes + 8);
  uint64_t type_and_count = load64(bytes + 24);
  c->type = (uint8_t)type_and_count;
  c->num_records = type_and_count >> 8;
  c->decoded_size = load64(bytes + 32);
  c->data = bytes + CHUNK_HEADER_SIZE;
  if (!fits(c->data, bytes + n, c->data_size)) return *why = "a chunk whose data runs past its span", CORRUPT;
  if (exact && c->data_size != n - CHUNK_HEADER_SIZE) {
    const uint8_t *pad = c->data + c->data_size;
    size_t left = (size_t)(bytes + n - pad);
    if (left < CHUNK_HEADER_SIZE || (uint8_t)load64(pad + 24) != PADDING_CHUNK || load64(pad + 24) >> 8 != 0 ||
        load64(pad + 8) != left - CHUNK_HEADER_SIZE || (check && highway_hash64(pad + 8, 32) != load64(pad)))
      return *why = "a chunk that ends before its span (a stale or damaged index?)", CORRUPT;
  }
  if (check && highway_hash64(c->data, c->data_size) != load64(bytes + 16))
    return *why = "chunk data whose hash does not match", CORRUPT;
  return OK;
}

/* A simple chunk's sizes and values blobs. */
static int split_simple(const chunk *c, uint8_t *compression, const uint8_t **sizes, size_t *sizes_len,
                        const uint8_t **values, size_t *values_len, const char **why) {
  if (c->type != SIMPLE_CHUNK) return *why = "a chunk that is not a simple chunk (transposed?)", UNSUPPORTED;
  const uint8_t *p = c->data, *end = c->data + c->data_size;
  uint64_t n;
  if (p >= end) return *why = "an empty simple chunk", CORRUPT;
  *compression = *p++;
  if (read_varint(&p, end, &n) || n > (uint64_t)(end - p)) return *why = "a sizes blob past the chunk's end", CORRUPT;
  *sizes = p;
  *sizes_len = (size_t)n;
  *values = p + n;
  *values_len = (size_t)(end - p - n);
  return OK;
}

/* Checks a one-record simple chunk before its record is allocated: its sizes blob names decoded_size, which is at
   most max_record and what its values blob can decode to. Keeps the values blob in the chunk for decode_single. */
static int check_single(chunk *c, uint64_t max_record, const char **why) {
  uint8_t sizes_buf[16];
  const uint8_t *sizes;
  size_t sizes_len;
  int rc = split_simple(c, &c->compression, &sizes, &sizes_len, &c->values, &c->values_len, why);
  if (rc) return rc;
  /* the sizes blob holds one varint; decompressed it is at most 10 bytes */
  const uint8_t *plain = sizes;
  size_t plain_len = sizes_len;
  if (c->compression != 0) {
    const uint8_t *q = sizes;
    uint64_t size;
    if (read_varint(&q, sizes + sizes_len, &size) || size > 10) return *why = "a bad sizes blob", CORRUPT;
    rc = blob_can_hold(c->compression, sizes, sizes_len, size, why);
    if (!rc) rc = decompress_blob(c->compression, sizes, sizes_len, sizes_buf, (size_t)size, why);
    if (rc) return rc;
    plain = sizes_buf;
    plain_len = (size_t)size;
  }
  const uint8_t *q = plain;
  uint64_t record_size;
  if (read_varint(&q, plain + plain_len, &record_size) || q != plain + plain_len || record_size != c->decoded_size)
    return *why = "a record size that disagrees with the chunk header", CORRUPT;
  rc = blob_can_hold(c->compression, c->values, c->values_len, c->decoded_size, why);
  if (!rc && c->decoded_size > max_record) return *why = "a record larger than max_record_bytes", TOO_LARGE;
  return rc;
}

/* Decodes a chunk that passed check_single into dst (decoded_size bytes). */
static int decode_single(const chunk *c, uint8_t *dst, const char **why) {
  return decompress_blob(c->compression, c->values, c->values_len, dst, (size_t)c->decoded_size, why);
}

/* ------------------------------------------------------------------------------------------------ */
/* Block headers.                                                                                   */

/* File position (>= 0) -> position in the stream with every block header removed. */
static inline int64_t logical(int64_t pos) {
  int64_t in_block = pos % BLOCK_SIZE;
  return pos - (pos / BLOCK_SIZE) * BLOCK_HEADER_SIZE - (in_block < BLOCK_HEADER_SIZE ? in_block : BLOCK_HEADER_SIZE);
}

/* Removes the block-header bytes from buf, which holds file bytes [begin, begin + n); returns the new length. */
static size_t strip_block_headers(uint8_t *buf, int64_t begin, size_t n) {
  size_t out = 0, in = 0;
  while (in < n) {
    int64_t pos = begin + (int64_t)in;
    int64_t in_block = pos % BLOCK_SIZE;
    if (in_block < BLOCK_HEADER_SIZE) {
      size_t skip = (size_t)(BLOCK_HEADER_SIZE - in_block);
      in += skip < n - in ? skip : n - in;
      continue;
    }
    size_t run = (size_t)(BLOCK_SIZE - in_block);
    if (run > n - in) run = n - in;
    if (out != in) memmove(buf + out, buf + in, run);
    out += run;
    in += run;
  }
  return out;
}

/* ------------------------------------------------------------------------------------------------ */
/* Reading records.                                                                                 */

typedef struct {
  int64_t fd, begin, end; /* file bytes [begin, end) */
  uint8_t *buf;           /* in the batch's arena; block headers removed */
  size_t len;
} span;

typedef struct {
  Py_ssize_t n;
  const int64_t *fds, *begins, *ends;
  int64_t *span_of;   /* per record: its span */
  chunk *chunks;      /* per record: its parsed chunk */
  span *spans;
  uint8_t *arena;     /* every span's bytes: the thread's kept buffer, or its own when arena_private */
  int arena_private;
  int arena_held;     /* this read holds the thread's buffer (set even when it is NULL: a read of no bytes) */
  Py_ssize_t num_spans;
  uint64_t max_record; /* the largest record to allocate */
  uint64_t read_decoded; /* when a read is refused as too large: what it would have decoded to */
  Py_ssize_t failed;  /* the record an error is about */
  const char *why;
  int err_no;
} batch;

/* Groups records (sorted by file, then begin) into spans: a record joins the previous span when it is in the same
   file and starts at most max_gap bytes after that span's end (max_gap -1: only a record overlapping the span, the
   same chunk again) and, when waste >= 0, the span then reads at most waste percent more bytes than its records
   hold (a gs:// read pays for every byte: this bounds what merging costs in bandwidth). */
static int plan(batch *b, int64_t max_gap, int64_t waste) {
  b->spans = calloc((size_t)(b->n ? b->n : 1), sizeof(span));
  b->span_of = malloc(sizeof(int64_t) * (size_t)(b->n ? b->n : 1));
  b->chunks = calloc((size_t)(b->n ? b->n : 1), sizeof(chunk));
  if (!b->spans || !b->span_of || !b->chunks) return NO_MEMORY;
  Py_ssize_t s = -1;
  int64_t needed = 0; /* bytes of span s that its records hold */
  for (Py_ssize_t i = 0; i < b->n; i++) {
    if (b->begins[i] < 0 || b->ends[i] < b->begins[i] || b->ends[i] > INT64_MAX / 2)
      return b->failed = i, b->why = "an index entry outside the file", CORRUPT;
    int join = s >= 0 && b->fds[i] == b->spans[s].fd && b->begins[i] >= b->spans[s].begin &&
               b->begins[i] <= b->spans[s].end + max_gap;
    int64_t adds = 0; /* the record's bytes past the span's end */
    if (join) {
      int64_t from = b->begins[i] > b->spans[s].end ? b->begins[i] : b->spans[s].end;
      adds = b->ends[i] > from ? b->ends[i] - from : 0;
      if (waste >= 0 && b->begins[i] > b->spans[s].end) { /* a gap: within the budget? (all values < 2^62) */
        unsigned __int128 length = (unsigned __int128)(b->ends[i] - b->spans[s].begin);
        unsigned __int128 allowed = (unsigned __int128)(needed + adds) * (unsigned __int128)(100 + waste);
        join = length * 100 <= allowed;
      }
    }
    if (join) {
      if (b->ends[i] > b->spans[s].end) b->spans[s].end = b->ends[i];
      needed += adds;
    } else {
      s++;
      b->spans[s].fd = b->fds[i];
      b->spans[s].begin = b->begins[i];
      b->spans[s].end = b->ends[i];
      needed = b->ends[i] - b->begins[i];
    }
    b->span_of[i] = s;
  }
  b->num_spans = s + 1;
  return OK;
}

/* Each thread keeps the buffer its last read used, so a read group's bytes land in pages already mapped: a fresh
   buffer of tens of MB per read cost page faults, zeroing and unmapping (~40% of a read of 1 KB records). A buffer
   over ARENA_KEEP is freed after its read; a thread's buffer is freed when the thread ends (a pthread key's
   destructor: the loader's threads come and go with its iterators). A read that fits is given a buffer that fits
   too: the loader's read groups hold up to ~64 MB, and a buffer of 1.25x that went over the limit and was freed
   after every read (100 KB records: 0.19 against 0.12 ms a record read, in page faults and zeroing). */
#define ARENA_KEEP ((size_t)96 << 20)
static __thread uint8_t *thread_arena;
static __thread size_t thread_arena_size;
static __thread int thread_arena_busy; /* a read on this thread holds it (a nested one, from a finalizer run by
                                          an allocation, gets its own buffer); batch.arena_held says which read */
static pthread_key_t arena_key;        /* its value: the thread's buffer, freed at the thread's exit */
static int64_t arenas_kept;            /* buffers kept by threads now (tests: none outlives its thread) */

static void arena_release(void *arena) {
  free(arena);
  __atomic_fetch_sub(&arenas_kept, 1, __ATOMIC_RELAXED);
}

static void arena_drop(void) { /* the calling thread's buffer, freed now */
  if (!thread_arena) return;
  pthread_setspecific(arena_key, NULL);
  arena_release(thread_arena);
  thread_arena = NULL;
  thread_arena_size = 0;
}

/* One allocation holds every span: the thread's kept buffer (grown when too small). */
static int alloc_spans(batch *b) {
  size_t total = 0;
  for (Py_ssize_t s = 0; s < b->num_spans; s++) total += (size_t)(b->spans[s].end - b->spans[s].begin);
  if (thread_arena_busy) {
    b->arena = malloc(total ? total : 1);
    if (!b->arena) return NO_MEMORY;
    b->arena_private = 1;
  } else if (total > thread_arena_size) {
    size_t want = total + total / 4; /* room for the next read group's few more bytes, without a new buffer */
    if (total <= ARENA_KEEP && want > ARENA_KEEP) want = ARENA_KEEP;
    arena_drop();
    thread_arena = malloc(want);
    if (!thread_arena) return NO_MEMORY;
    __atomic_fetch_add(&arenas_kept, 1, __ATOMIC_RELAXED);
    thread_arena_size = want;
    pthread_setspecific(arena_key, thread_arena);
  }
  if (!b->arena_private) {
    b->arena = thread_arena;
    b->arena_held = thread_arena_busy = 1;
  }
  total = 0;
  for (Py_ssize_t s = 0; s < b->num_spans; s++) {
    b->spans[s].buf = b->arena + total;
    total += (size_t)(b->spans[s].end - b->spans[s].begin);
  }
  return OK;
}

static int read_spans(batch *b) {
  int rc = alloc_spans(b);
  if (rc) return rc;
  for (Py_ssize_t s = 0; s < b->num_spans; s++) {
    span *sp = &b->spans[s];
    size_t n = (size_t)(sp->end - sp->begin);
    size_t got = 0;
    while (got < n) {
      ssize_t r = pread((int)sp->fd, sp->buf + got, n - got, (off_t)(sp->begin + (int64_t)got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        for (Py_ssize_t i = 0; i < b->n; i++)
          if (b->span_of[i] == s) { b->failed = i; break; }
        b->err_no = r < 0 ? errno : 0;
        b->why = r < 0 ? "the read failed" : "the file ends before the record (truncated file?)";
        return r < 0 ? IO_ERROR : CORRUPT;
      }
      got += (size_t)r;
    }
    sp->len = strip_block_headers(sp->buf, sp->begin, n);
  }
  return OK;
}

/* Parses every record's chunk (hash checks, sizes) with the GIL released. */
/* A read decodes to at most READ_RATIO times the bytes it read, or max_record when that is more: a shard of many
   small zstd frames that each expand to max_record (a few KB apiece) must not make one read group allocate
   hundreds of GB. Real data stays far below it (1 MB masks at 1,000x pass); zeros at 25,000x need max_record raised. */
#define READ_RATIO 1024
#define READ_ALLOWANCE ((uint64_t)64 << 20)

static int parse_all(batch *b, int check) {
  uint64_t stored = 0, decoded = 0;
  for (Py_ssize_t s = 0; s < b->num_spans; s++) stored += (uint64_t)(b->spans[s].end - b->spans[s].begin);
  uint64_t budget = stored > (UINT64_MAX - READ_ALLOWANCE) / READ_RATIO ? UINT64_MAX
                                                                        : stored * READ_RATIO + READ_ALLOWANCE;
  if (budget < b->max_record) budget = b->max_record;
  for (Py_ssize_t i = 0; i < b->n; i++) {
    span *sp = &b->spans[b->span_of[i]];
    int64_t at = logical(b->begins[i]) - logical(sp->begin), to = logical(b->ends[i]) - logical(sp->begin);
    if (at < 0 || to > (int64_t)sp->len) return b->failed = i, b->why = "a span that misses the record", CORRUPT;
    chunk *c = &b->chunks[i];
    int rc = parse_chunk(sp->buf + at, (size_t)(to - at), check, 1, c, &b->why);
    if (!rc && c->num_records != 1) rc = UNSUPPORTED, b->why = "a chunk of several records (group_size > 1)";
    if (!rc) rc = check_single(c, b->max_record, &b->why);
    if (rc) return b->failed = i, rc;
    decoded += c->decoded_size; /* each <= max_record < 2^63, and the sum is checked before the next: no wrap */
    if (decoded > budget) {
      b->why = "a read that decodes to more than 1024 times its bytes and max_record_bytes";
      b->read_decoded = decoded;
      return b->failed = i, TOO_LARGE;
    }
  }
  return OK;
}

static void batch_free(batch *b) {
  if (b->arena_private) {
    free(b->arena);
  } else if (b->arena_held) {
    thread_arena_busy = 0;
    if (thread_arena_size > ARENA_KEEP) arena_drop(); /* a rare huge read: give its memory back */
  }
  free(b->spans);
  free(b->span_of);
  free(b->chunks);
}

static PyObject *raise_for(batch *b, int rc) {
  if (rc == NO_MEMORY) return PyErr_NoMemory();
  if (rc == IO_ERROR) {
    errno = b->err_no;
    PyObject *e = PyErr_SetFromErrno(PyExc_OSError);
    return e;
  }
  /* (why, record position, the record's declared size when it is too large) */
  unsigned long long size = rc != TOO_LARGE || !b->chunks ? 0
                            : b->read_decoded             ? (unsigned long long)b->read_decoded
                                                          : (unsigned long long)b->chunks[b->failed].decoded_size;
  PyObject *args = Py_BuildValue("(snK)", b->why ? b->why : "a bad chunk", b->failed, size);
  if (args) {
    PyErr_SetObject(rc == UNSUPPORTED ? UnsupportedError : rc == TOO_LARGE ? TooLargeError : CorruptError, args);
    Py_DECREF(args);
  }
  return NULL;
}

/* After plan + spans filled: parse, make the bytes objects, decode into them. Consumes nothing; frees nothing. */
static PyObject *decode_batch(batch *b, int check) {
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = parse_all(b, check);
  Py_END_ALLOW_THREADS if (rc) return raise_for(b, rc);
  PyObject *out = PyList_New(b->n);
  if (!out) return NULL;
  for (Py_ssize_t i = 0; i < b->n; i++) {
    PyObject *record = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)b->chunks[i].decoded_size);
    if (!record) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, i, record);
  }
  Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < b->n; i++) {
    rc = decode_single(&b->chunks[i], (uint8_t *)PyBytes_AS_STRING(PyList_GET_ITEM(out, i)), &b->why);
    if (rc) {
      b->failed = i;
      break;
    }
  }
  Py_END_ALLOW_THREADS if (rc) {
    Py_DECREF(out);
    return raise_for(b, rc);
  }
  return out;
}

/* Borrows an int64 array argument; 0 on success. */
static int int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *name) {
  if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0))) return -1;
  if (view->itemsize != 8 || !view->format || (strcmp(view->format, "q") && strcmp(view->format, "l") &&
                                               strcmp(view->format, "<q") && strcmp(view->format, "<l"))) {
    PyErr_Format(PyExc_TypeError, "%s must be an int64 array", name);
    PyBuffer_Release(view);
    return -1;
  }
  return 0;
}

typedef struct {
  Py_buffer fds, begins, ends;
  int held;
} record_args;

static int record_args_get(record_args *a, PyObject *fds, PyObject *begins, PyObject *ends, Py_ssize_t *n) {
  memset(a, 0, sizeof(*a));
  if (int64_buffer(fds, &a->fds, 0, "fds")) return -1;
  if (int64_buffer(begins, &a->begins, 0, "begins")) {
    PyBuffer_Release(&a->fds);
    return -1;
  }
  if (int64_buffer(ends, &a->ends, 0, "ends")) {
    PyBuffer_Release(&a->fds);
    PyBuffer_Release(&a->begins);
    return -1;
  }
  a->held = 1;
  *n = a->begins.len / 8;
  if (a->fds.len != a->begins.len || a->ends.len != a->begins.len) {
    PyErr_SetString(PyExc_ValueError, "fds, begins and ends must have one entry per record");
    return -1;
  }
  return 0;
}

static void record_args_release(record_args *a) {
  if (!a->held) return;
  PyBuffer_Release(&a->fds);
  PyBuffer_Release(&a->begins);
  PyBuffer_Release(&a->ends);
  a->held = 0;
}

/* The largest record a read may allocate (max_record): at most what a bytes object can hold. */
static uint64_t record_limit(long long max_record) {
  return max_record < 0 || (unsigned long long)max_record > (unsigned long long)PY_SSIZE_T_MAX - 64
             ? (uint64_t)PY_SSIZE_T_MAX - 64
             : (uint64_t)max_record;
}

/* read(fds, begins, ends, check, max_gap, max_record=-1) -> list[bytes] */
static PyObject *py_read(PyObject *self, PyObject *args) {
  PyObject *fds, *begins, *ends;
  int check;
  long long max_gap, max_record = -1;
  if (!PyArg_ParseTuple(args, "OOOpL|L", &fds, &begins, &ends, &check, &max_gap, &max_record)) return NULL;
  record_args a;
  batch b = {0};
  b.max_record = record_limit(max_record);
  PyObject *out = NULL;
  if (record_args_get(&a, fds, begins, ends, &b.n)) goto done;
  b.fds = a.fds.buf;
  b.begins = a.begins.buf;
  b.ends = a.ends.buf;
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = plan(&b, max_gap, -1);
  if (!rc) rc = read_spans(&b);
  Py_END_ALLOW_THREADS if (rc) {
    raise_for(&b, rc);
    goto done;
  }
  out = decode_batch(&b, check);
done:
  batch_free(&b);
  record_args_release(&a);
  return out;
}

/* plan_spans(fds, begins, ends, max_gap, span_of_out, waste=-1) -> list[(fd, begin, end)]: the spans read() would
   read (waste >= 0: each span reads at most waste percent more bytes than its records hold). */
static PyObject *py_plan_spans(PyObject *self, PyObject *args) {
  PyObject *fds, *begins, *ends, *span_of;
  long long max_gap, waste = -1;
  if (!PyArg_ParseTuple(args, "OOOLO|L", &fds, &begins, &ends, &max_gap, &span_of, &waste)) return NULL;
  if (max_gap < -1 || waste < -1 || waste > 1000000) {
    PyErr_Format(PyExc_ValueError, "max_gap must be >= -1 and waste in [-1, 1e6] (got %lld, %lld)", max_gap, waste);
    return NULL;
  }
  record_args a;
  batch b = {0};
  PyObject *out = NULL;
  Py_buffer span_view = {0};
  if (record_args_get(&a, fds, begins, ends, &b.n)) goto done;
  if (int64_buffer(span_of, &span_view, 1, "span_of")) goto done;
  if (span_view.len != a.begins.len) {
    PyErr_SetString(PyExc_ValueError, "span_of must have one entry per record");
    goto done;
  }
  b.fds = a.fds.buf;
  b.begins = a.begins.buf;
  b.ends = a.ends.buf;
  int rc = plan(&b, max_gap, waste);
  if (rc) {
    raise_for(&b, rc);
    goto done;
  }
  memcpy(span_view.buf, b.span_of, sizeof(int64_t) * (size_t)b.n);
  out = PyList_New(b.num_spans);
  for (Py_ssize_t s = 0; out && s < b.num_spans; s++) {
    PyObject *t = Py_BuildValue("(LLL)", (long long)b.spans[s].fd, (long long)b.spans[s].begin,
                                (long long)b.spans[s].end);
    if (!t) {
      Py_CLEAR(out);
      break;
    }
    PyList_SET_ITEM(out, s, t);
  }
done:
  if (span_view.obj) PyBuffer_Release(&span_view);
  batch_free(&b);
  record_args_release(&a);
  return out;
}

/* decode(buffers, fds, begins, ends, check, max_gap) -> list[bytes]: as read(), with each span's bytes given
   (buffers[s] holds the file bytes of span s of plan_spans; it is copied, then its block headers removed). */
static PyObject *py_decode(PyObject *self, PyObject *args) {
  PyObject *buffers, *fds, *begins, *ends;
  int check;
  long long max_gap, max_record = -1;
  if (!PyArg_ParseTuple(args, "OOOOpL|L", &buffers, &fds, &begins, &ends, &check, &max_gap, &max_record)) return NULL;
  if (max_gap < -1) {
    PyErr_Format(PyExc_ValueError, "max_gap must be >= -1 (got %lld)", max_gap);
    return NULL;
  }
  record_args a;
  batch b = {0};
  b.max_record = record_limit(max_record);
  PyObject *out = NULL;
  Py_buffer *views = NULL;
  Py_ssize_t held = 0;
  if (record_args_get(&a, fds, begins, ends, &b.n)) goto done;
  b.fds = a.fds.buf;
  b.begins = a.begins.buf;
  b.ends = a.ends.buf;
  int rc = plan(&b, max_gap, -1);
  if (rc) {
    raise_for(&b, rc);
    goto done;
  }
  if (!PyList_Check(buffers) || PyList_GET_SIZE(buffers) != b.num_spans) {
    PyErr_Format(PyExc_ValueError, "decode() needs a list of %zd span buffers", b.num_spans);
    goto done;
  }
  if (alloc_spans(&b)) {
    PyErr_NoMemory();
    goto done;
  }
  /* Every span's buffer is held first; the bytes are then copied without the GIL (on 100 KB records read from
     gs://, a read group copies ~64 MB here, which held the event loop's thread off meanwhile). */
  views = PyMem_Calloc((size_t)b.num_spans, sizeof(Py_buffer));
  if (!views) {
    PyErr_NoMemory();
    goto done;
  }
  for (; held < b.num_spans; held++) {
    if (PyObject_GetBuffer(PyList_GET_ITEM(buffers, held), &views[held], PyBUF_C_CONTIGUOUS)) goto done;
    if (views[held].len != b.spans[held].end - b.spans[held].begin) {
      PyErr_Format(PyExc_ValueError, "span %zd has %zd bytes, expected %lld", held, views[held].len,
                   (long long)(b.spans[held].end - b.spans[held].begin));
      held++;
      goto done;
    }
  }
  Py_BEGIN_ALLOW_THREADS for (Py_ssize_t s = 0; s < b.num_spans; s++) {
    size_t n = (size_t)(b.spans[s].end - b.spans[s].begin);
    memcpy(b.spans[s].buf, views[s].buf, n);
    b.spans[s].len = strip_block_headers(b.spans[s].buf, b.spans[s].begin, n);
  }
  Py_END_ALLOW_THREADS out = decode_batch(&b, check);
done:
  for (Py_ssize_t s = 0; s < held; s++) PyBuffer_Release(&views[s]);
  PyMem_Free(views);
  batch_free(&b);
  record_args_release(&a);
  return out;
}

/* Bytes of decoded footer records allowed per record: an ArrayRecordFooter is 3 varint fields (<= 33 bytes); the
   first record, the metadata with the writer's options, gets FOOTER_METADATA_MAX more. */
#define FOOTER_RECORD_MAX 64
#define FOOTER_METADATA_MAX (1 << 16)

/* decode_chunk(data, position, check, max_records) -> (sizes: bytes of little-endian u64, values: bytes). `data`
   holds the file bytes of one simple chunk starting at file `position` (block headers are removed here); padding
   may follow it. A chunk of more than max_records records, or of more decoded bytes than FOOTER_RECORD_MAX a record
   (plus FOOTER_METADATA_MAX), is refused before anything is allocated for it: the caller bounds max_records by the
   file (a chunk takes at least 40 bytes). */
static PyObject *py_decode_chunk(PyObject *self, PyObject *args) {
  Py_buffer view;
  long long position, max_records;
  int check;
  if (!PyArg_ParseTuple(args, "y*LpL", &view, &position, &check, &max_records)) return NULL;
  PyObject *out = NULL, *sizes_out = NULL, *values_out = NULL;
  uint8_t *buf = NULL, *plain_sizes = NULL;
  const char *why = NULL;
  int rc = OK;
  chunk c;
  uint8_t compression = 0;
  const uint8_t *sizes = NULL, *values = NULL;
  size_t sizes_len = 0, values_len = 0, plain_len = 0;
  if (position < 0 || max_records < 0) {
    PyErr_SetString(PyExc_ValueError, "decode_chunk: position and max_records must be >= 0");
    goto done;
  }
  if (!(buf = malloc(view.len ? (size_t)view.len : 1))) {
    PyErr_NoMemory();
    goto done;
  }
  memcpy(buf, view.buf, (size_t)view.len);
  size_t len = strip_block_headers(buf, position, (size_t)view.len);
  Py_BEGIN_ALLOW_THREADS rc = parse_chunk(buf, len, check, 0, &c, &why);
  if (!rc) rc = split_simple(&c, &compression, &sizes, &sizes_len, &values, &values_len, &why);
  if (!rc && (c.num_records > (uint64_t)max_records ||
              c.decoded_size > FOOTER_METADATA_MAX + FOOTER_RECORD_MAX * c.num_records))
    rc = CORRUPT, why = "a chunk of more records or bytes than the file can hold";
  if (!rc && compression != 0) {
    const uint8_t *q = sizes;
    uint64_t size;
    /* each record's size is a varint of 1 to 10 bytes */
    if (read_varint(&q, sizes + sizes_len, &size) || size < c.num_records || size / 10 > c.num_records) {
      rc = CORRUPT, why = "a bad sizes blob";
    } else if (!(rc = blob_can_hold(compression, sizes, sizes_len, size, &why))) {
      if (!(plain_sizes = malloc(size ? (size_t)size : 1))) {
        rc = NO_MEMORY;
      } else {
        plain_len = (size_t)size;
        rc = decompress_blob(compression, sizes, sizes_len, plain_sizes, plain_len, &why);
      }
    }
  } else if (!rc) {
    if (sizes_len < c.num_records) {
      rc = CORRUPT, why = "a bad sizes blob";
    } else if (!(plain_sizes = malloc(sizes_len ? sizes_len : 1))) {
      rc = NO_MEMORY;
    } else {
      memcpy(plain_sizes, sizes, plain_len = sizes_len);
    }
  }
  if (!rc) rc = blob_can_hold(compression, values, values_len, c.decoded_size, &why);
  Py_END_ALLOW_THREADS if (rc) {
    batch b = {0};
    b.why = why;
    raise_for(&b, rc);
    goto done;
  }
  /* num_records <= plain_len and decoded_size <= FOOTER_... * num_records: both bounded by the chunk's bytes */
  sizes_out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * c.num_records));
  values_out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)c.decoded_size);
  if (!sizes_out || !values_out) goto done;
  {
    uint64_t *out_sizes = (uint64_t *)PyBytes_AS_STRING(sizes_out), left = c.decoded_size;
    const uint8_t *q = plain_sizes, *end = plain_sizes + plain_len;
    for (uint64_t i = 0; i < c.num_records; i++) {
      if (read_varint(&q, end, &out_sizes[i])) {
        rc = CORRUPT, why = "a sizes blob with fewer sizes than records";
        break;
      }
      if (out_sizes[i] > left) { /* subtracting never wraps: sizes that sum past decoded_size are refused */
        rc = CORRUPT, why = "record sizes that add up to more than the chunk";
        break;
      }
      left -= out_sizes[i];
    }
    if (!rc && (q != end || left != 0)) rc = CORRUPT, why = "record sizes that disagree with the chunk";
    if (!rc) {
      Py_BEGIN_ALLOW_THREADS rc = decompress_blob(compression, values, values_len,
                                                   (uint8_t *)PyBytes_AS_STRING(values_out),
                                                   (size_t)c.decoded_size, &why);
      Py_END_ALLOW_THREADS
    }
    if (rc) {
      batch b = {0};
      b.why = why;
      raise_for(&b, rc);
      goto done;
    }
  }
  out = PyTuple_Pack(2, sizes_out, values_out);
done:
  Py_XDECREF(sizes_out);
  Py_XDECREF(values_out);
  free(buf);
  free(plain_sizes);
  PyBuffer_Release(&view);
  return out;
}

/* ------------------------------------------------------------------------------------------------ */
/* The compact index (loader/format/index.py writes it): for each shard a table of the chunk offset of every
   stride-th record (u64) and, per record, the distance from its chunk to the next (u16 or u32).            */

/* ------------------------------------------------------------------------------------------------ */
/* The index's Elias-Fano code of each shard's chunk offsets (loader/format/index.py).                     */
/* m nondecreasing values v < U: each splits into its low `l` bits (l = floor(log2(U / m)), packed end to end) and
   its high part, coded in unary as the set bit at position (v >> l) + i of a bit vector of at most 2m + 1 bits; the
   position of every SAMPLE-th set bit is kept. l + 2 to l + 3 bits a value: ~1.5 bytes for chunks of ~1 KB. */

static inline int64_t ef_next_ones(const uint64_t *hi, int64_t hi_words, int64_t pos, int64_t d) {
  /* the position of the d-th set bit after position pos (d >= 0; d == 0: pos); -1 when the hi_words words of the
     bit vector run out first (a damaged index) */
  if (pos < 0 || (pos >> 6) >= hi_words) return -1;
  if (d == 0) return pos;
  int64_t w = pos >> 6;
  int b = (int)(pos & 63);
  uint64_t word = b == 63 ? 0 : hi[w] & (~0ULL << (b + 1));
  for (;;) {
    int64_t c = __builtin_popcountll(word);
    if (c >= d) break;
    d -= c;
    if (++w >= hi_words) return -1;
    word = hi[w];
  }
  for (int64_t k = 1; k < d; k++) word &= word - 1;
  return (w << 6) + __builtin_ctzll(word);
}

static inline uint64_t ef_low(const uint64_t *lo, int64_t i, int64_t l) {
  if (l == 0) return 0;
  uint64_t bit = (uint64_t)i * (uint64_t)l, w = bit >> 6, sh = bit & 63;
  uint64_t x = lo[w] >> sh;
  if (sh + (uint64_t)l > 64) x |= lo[w + 1] << (64 - sh);
  return l == 64 ? x : x & ((1ULL << l) - 1);
}

/* ef_encode(values: uint64 array, sample) -> (l, samples, highs, lows): the code of `values` (bytes of u64 words). */
static PyObject *py_ef_encode(PyObject *self, PyObject *args) {
  Py_buffer view;
  long long sample;
  if (!PyArg_ParseTuple(args, "y*L", &view, &sample)) return NULL;
  PyObject *result = NULL, *samples = NULL, *highs = NULL, *lows = NULL;
  int64_t m = view.len / 8;
  const uint64_t *v = view.buf;
  if (m < 1 || view.len % 8 || sample < 1) {
    PyErr_SetString(PyExc_ValueError, "ef_encode: needs at least one u64 value and sample >= 1");
    goto done;
  }
  for (int64_t i = 1; i < m; i++)
    if (v[i] < v[i - 1]) {
      PyErr_Format(PyExc_ValueError, "chunk offsets decrease at record %lld (%llu after %llu)", (long long)i,
                   (unsigned long long)v[i], (unsigned long long)v[i - 1]);
      goto done;
    }
  uint64_t universe = v[m - 1] + 1, ratio = universe / (uint64_t)m;
  int64_t l = ratio ? 63 - __builtin_clzll(ratio) : 0;
  int64_t hi_bits = m + (int64_t)(v[m - 1] >> l) + 1, hi_words = (hi_bits + 63) / 64;
  int64_t lo_words = (m * l + 63) / 64, num_samples = (m + sample - 1) / sample;
  samples = PyBytes_FromStringAndSize(NULL, num_samples * 8);
  highs = PyBytes_FromStringAndSize(NULL, hi_words * 8);
  lows = PyBytes_FromStringAndSize(NULL, lo_words * 8);
  if (!samples || !highs || !lows) goto done;
  uint64_t *sp = (uint64_t *)PyBytes_AS_STRING(samples), *hp = (uint64_t *)PyBytes_AS_STRING(highs),
           *lp = (uint64_t *)PyBytes_AS_STRING(lows);
  memset(hp, 0, (size_t)hi_words * 8);
  memset(lp, 0, (size_t)lo_words * 8);
  const uint64_t mask = l ? (l == 64 ? ~0ULL : (1ULL << l) - 1) : 0;
  for (int64_t i = 0; i < m; i++) {
    int64_t p = (int64_t)(v[i] >> l) + i;
    hp[p >> 6] |= 1ULL << (p & 63);
    if (i % sample == 0) sp[i / sample] = (uint64_t)p;
    if (l) {
      uint64_t bit = (uint64_t)i * (uint64_t)l, w = bit >> 6, sh = bit & 63, low = v[i] & mask;
      lp[w] |= low << sh;
      if (sh + (uint64_t)l > 64) lp[w + 1] |= low >> (64 - sh);
    }
  }
  result = Py_BuildValue("(LOOO)", (long long)l, samples, highs, lows);
done:
  Py_XDECREF(samples);
  Py_XDECREF(highs);
  Py_XDECREF(lows);
  PyBuffer_Release(&view);
  return result;
}

/* locate(index, shard_info, shards, locals, begins_out, ends_out): the chunk span [begin, end) of record `local`
   of each shard: values local and local + 1 of its code. index: the index file (u64 words);
   shard_info: int64 [num_shards, 6] = (samples at, highs at, lows at (u64 word offsets), l, values, sample).
   Records are visited in the given order; a run within one shard walks forward from the last one.
   The index is a file, so nothing in it is trusted: every word read lies inside its shard's section of the file
   (loader/format/index.py also checks each shard's row and a hash of the whole file when it opens one). */
static int ef_row_ok(const int64_t *f, int64_t words) {
  int64_t samples_at = f[0], highs_at = f[1], lows_at = f[2], l = f[3], count = f[4], sample = f[5];
  if (count < 2 || count > ((int64_t)1 << 48) || sample < 1 || l < 0 || l > 63) return 0;
  if (samples_at < 0 || highs_at < samples_at || lows_at < highs_at || lows_at > words) return 0;
  if ((count + sample - 1) / sample > highs_at - samples_at) return 0;
  return (count * l + 63) / 64 <= words - lows_at;
}
static PyObject *py_locate(PyObject *self, PyObject *args) {
  PyObject *index_obj, *info_obj, *shards_obj, *locals_obj, *begins_obj, *ends_obj;
  if (!PyArg_ParseTuple(args, "OOOOOO", &index_obj, &info_obj, &shards_obj, &locals_obj, &begins_obj, &ends_obj))
    return NULL;
  Py_buffer index = {0}, info = {0}, shards = {0}, locs = {0}, begins = {0}, ends = {0};
  PyObject *result = NULL;
  if (PyObject_GetBuffer(index_obj, &index, PyBUF_C_CONTIGUOUS)) goto done;
  if (int64_buffer(info_obj, &info, 0, "shard_info")) goto done;
  if (int64_buffer(shards_obj, &shards, 0, "shards")) goto done;
  if (int64_buffer(locals_obj, &locs, 0, "locals")) goto done;
  if (int64_buffer(begins_obj, &begins, 1, "begins_out")) goto done;
  if (int64_buffer(ends_obj, &ends, 1, "ends_out")) goto done;
  {
    Py_ssize_t n = shards.len / 8, num_shards = info.len / 48;
    const int64_t *inf = info.buf, *sh = shards.buf, *lo = locs.buf;
    const uint64_t *words = index.buf;
    int64_t *bo = begins.buf, *eo = ends.buf;
    if (locs.len != shards.len || begins.len != shards.len || ends.len != shards.len) {
      PyErr_SetString(PyExc_ValueError, "locate: arrays of different lengths");
      goto done;
    }
    if ((uintptr_t)index.buf % 8) {
      PyErr_SetString(PyExc_ValueError, "locate: the index must be 8-byte aligned");
      goto done;
    }
    int bad = 0;
    int64_t num_words = index.len / 8;
    Py_BEGIN_ALLOW_THREADS int64_t cur_shard = -1, cur_elem = 0, cur_pos = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
      int64_t s = sh[i], e = lo[i];
      if (s < 0 || s >= num_shards) {
        bad = 1;
        break;
      }
      const int64_t *f = inf + 6 * s;
      int64_t l = f[3], count = f[4], sample = f[5], hi_words = f[2] - f[1];
      if (e < 0 || e + 1 >= count) {
        bad = 1;
        break;
      }
      if (s != cur_shard && !ef_row_ok(f, num_words)) {
        bad = 2;
        break;
      }
      const uint64_t *hi = words + f[1], *low = words + f[2];
      if (!(s == cur_shard && e >= cur_elem && e - cur_elem < sample)) {
        cur_shard = s;
        cur_elem = (e / sample) * sample;
        cur_pos = (int64_t)words[f[0] + e / sample];
      }
      cur_pos = ef_next_ones(hi, hi_words, cur_pos, e - cur_elem);
      cur_elem = e;
      int64_t next = cur_pos < 0 ? -1 : ef_next_ones(hi, hi_words, cur_pos, 1);
      if (next < 0 || cur_pos < e || next <= e || ((uint64_t)(next - e - 1) >> (63 - l))) {
        bad = 2;
        cur_shard = -1;
        break;
      }
      bo[i] = (int64_t)((((uint64_t)(cur_pos - e)) << l) | ef_low(low, e, l));
      eo[i] = (int64_t)((((uint64_t)(next - e - 1)) << l) | ef_low(low, e + 1, l));
    }
    Py_END_ALLOW_THREADS if (bad) {
      if (bad == 1) PyErr_SetString(PyExc_IndexError, "locate: a shard or record index out of range");
      else PyErr_SetObject(CorruptError, Py_BuildValue("(snK)", "a damaged index", (Py_ssize_t)-1, 0ULL));
      goto done;
    }
  }
  result = Py_None;
  Py_INCREF(result);
done:
  if (index.obj) PyBuffer_Release(&index);
  if (info.obj) PyBuffer_Release(&info);
  if (shards.obj) PyBuffer_Release(&shards);
  if (locs.obj) PyBuffer_Release(&locs);
  if (begins.obj) PyBuffer_Release(&begins);
  if (ends.obj) PyBuffer_Release(&ends);
  return result;
}

/* footer_offsets(sizes, values, footer_offset, group) -> (offsets, counts: bytes of u64, records): the chunk offset
   and record count of each entry of an ArrayRecord footer (records after the first are ArrayRecordFooter{1:
   chunk_offset, 2: decoded_data_size, 3: num_records}; a missing num_records is 1), and their total. `sizes` and
   `values` are decode_chunk's output; sizes are re-checked here, each against the bytes left (they come from the
   file). The entries must describe chunks that can be in the file: offsets from FOOTER_FIRST_CHUNK on, each at least a
   chunk header after the last, the last a chunk header before the footer; counts of 1 to 2^40, and with the writer's
   `group` (its group_size, 0 when unknown) every chunk full but the last. */
#define FOOTER_FIRST_CHUNK 64 /* the file signature comes first */
#define FOOTER_MAX_COUNT ((uint64_t)1 << 40)
static PyObject *py_footer_offsets(PyObject *self, PyObject *args) {
  Py_buffer sizes, values;
  unsigned long long footer_offset, group;
  if (!PyArg_ParseTuple(args, "y*y*KK", &sizes, &values, &footer_offset, &group)) return NULL;
  Py_ssize_t records = sizes.len / 8, entries = records > 1 ? records - 1 : 0;
  PyObject *offsets = PyBytes_FromStringAndSize(NULL, entries * 8), *counts = PyBytes_FromStringAndSize(NULL,
                                                                                                     entries * 8);
  PyObject *out = NULL;
  const char *bad = NULL;
  uint64_t total = 0;
  if (!offsets || !counts) goto done;
  {
    const uint64_t *sz = sizes.buf;
    uint64_t *off = (uint64_t *)PyBytes_AS_STRING(offsets), *cnt = (uint64_t *)PyBytes_AS_STRING(counts);
    uint64_t next_at = FOOTER_FIRST_CHUNK; /* where the next chunk may start at the earliest */
    const uint8_t *p = values.buf, *end = p + values.len;
    if (records > 0) {
      if (!fits(p, end, sz[0])) bad = "a footer whose metadata runs past its end";
      else p += sz[0];
    }
    for (Py_ssize_t r = 1; r < records && !bad; r++) {
      if (!fits(p, end, sz[r])) {
        bad = "a footer entry that runs past the footer's end";
        break;
      }
      const uint8_t *q = p, *msg_end = p + sz[r];
      uint64_t chunk_offset = 0, num_records = 1;
      int has_offset = 0;
      while (q < msg_end && !bad) {
        uint64_t key, value;
        if (read_varint(&q, msg_end, &key) || (key & 7) != 0 || read_varint(&q, msg_end, &value))
          bad = "a footer entry that does not parse";
        else if (key >> 3 == 1) chunk_offset = value, has_offset = 1;
        else if (key >> 3 == 3) num_records = value;
      }
      if (bad) break;
      if (!has_offset) bad = "a footer entry without a chunk offset";
      else if (chunk_offset < next_at || footer_offset < CHUNK_HEADER_SIZE ||
               chunk_offset > footer_offset - CHUNK_HEADER_SIZE)
        bad = "chunk offsets that do not increase through the file";
      else if (num_records == 0 || num_records > FOOTER_MAX_COUNT)
        bad = "footer record counts of 0 or beyond any file";
      else if (group && (num_records > group || (r < records - 1 && num_records != group)))
        bad = "footer record counts that disagree with the writer's group_size";
      next_at = chunk_offset + CHUNK_HEADER_SIZE;
      off[r - 1] = chunk_offset;
      cnt[r - 1] = num_records;
      total += num_records;
      p = msg_end;
    }
  }
  if (bad) {
    PyErr_SetObject(CorruptError, Py_BuildValue("(snK)", bad, (Py_ssize_t)-1, 0ULL));
    goto done;
  }
  out = Py_BuildValue("(OOK)", offsets, counts, (unsigned long long)total);
done:
  Py_XDECREF(offsets);
  Py_XDECREF(counts);
  PyBuffer_Release(&sizes);
  PyBuffer_Release(&values);
  return out;
}

static PyObject *py_hash64(PyObject *self, PyObject *args) {
  Py_buffer view;
  int portable = 0;
  if (!PyArg_ParseTuple(args, "y*|p", &view, &portable)) return NULL;
  uint64_t h = portable ? highway_hash64_portable(view.buf, (size_t)view.len) : highway_hash64(view.buf, (size_t)view.len);
  PyBuffer_Release(&view);
  return PyLong_FromUnsignedLongLong(h);
}

/* ------------------------------------------------------------------------------------------------ */
/* Many files' sizes and modification times at once (the start of a dataset of 100,000 shards).    */

typedef struct {
  const char **paths;
  int64_t *sizes, *mtimes, *errnos, *ctimes, *inodes;
  Py_ssize_t begin, end;
} stat_job;

static void *stat_range(void *arg) {
  stat_job *j = arg;
  for (Py_ssize_t i = j->begin; i < j->end; i++) {
    struct stat st;
    if (stat(j->paths[i], &st) == 0) {
      j->sizes[i] = (int64_t)st.st_size;
#ifdef __APPLE__
      j->mtimes[i] = (int64_t)st.st_mtimespec.tv_sec * 1000000000 + st.st_mtimespec.tv_nsec;
      j->ctimes[i] = (int64_t)st.st_ctimespec.tv_sec * 1000000000 + st.st_ctimespec.tv_nsec;
#else
      j->mtimes[i] = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
      j->ctimes[i] = (int64_t)st.st_ctim.tv_sec * 1000000000 + st.st_ctim.tv_nsec;
#endif
      j->inodes[i] = (int64_t)st.st_ino;
      j->errnos[i] = S_ISREG(st.st_mode) ? 0 : EISDIR;
    } else {
      j->sizes[i] = j->mtimes[i] = j->ctimes[i] = j->inodes[i] = -1;
      j->errnos[i] = errno;
    }
  }
  return NULL;
}

#define STAT_THREADS_MAX 32
#define STAT_PER_THREAD 2048 /* fewer files than this per thread are not worth a thread */

/* stat_paths(paths, sizes_out, mtimes_ns_out, errnos_out, threads, ctimes_ns_out, inodes_out): stat(2) of each path
   (following links), on up to `threads` threads with the GIL released: a stat is ~3 us of system time, 100k shards
   ~0.3 s on one thread. The paths are held in a tuple of their own meanwhile (the caller's list may change). */
static PyObject *py_stat_paths(PyObject *self, PyObject *args) {
  PyObject *list, *sizes_obj, *mtimes_obj, *errnos_obj, *ctimes_obj, *inodes_obj;
  int threads;
  if (!PyArg_ParseTuple(args, "O!OOOiOO", &PyList_Type, &list, &sizes_obj, &mtimes_obj, &errnos_obj, &threads,
                        &ctimes_obj, &inodes_obj))
    return NULL;
  Py_buffer sizes = {0}, mtimes = {0}, errnos = {0}, ctimes = {0}, inodes = {0};
  PyObject *result = NULL, *held = PyList_AsTuple(list);
  const char **paths = NULL;
  if (!held) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(held);
  if (int64_buffer(sizes_obj, &sizes, 1, "sizes_out") || int64_buffer(mtimes_obj, &mtimes, 1, "mtimes_out") ||
      int64_buffer(errnos_obj, &errnos, 1, "errnos_out") || int64_buffer(ctimes_obj, &ctimes, 1, "ctimes_out") ||
      int64_buffer(inodes_obj, &inodes, 1, "inodes_out"))
    goto done;
  if (sizes.len / 8 != n || mtimes.len / 8 != n || errnos.len / 8 != n || ctimes.len / 8 != n ||
      inodes.len / 8 != n) {
    PyErr_SetString(PyExc_ValueError, "stat_paths: one output entry per path");
    goto done;
  }
  paths = malloc(sizeof(char *) * (size_t)(n ? n : 1));
  if (!paths) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *item = PyTuple_GET_ITEM(held, i);
    if (!PyUnicode_Check(item)) {
      PyErr_Format(PyExc_TypeError, "stat_paths: path %zd is not a str", i);
      goto done;
    }
    paths[i] = PyUnicode_AsUTF8(item); /* kept by the str, which `held` holds */
    if (!paths[i]) goto done;
  }
  Py_ssize_t most = n / STAT_PER_THREAD; /* at most STAT_THREADS_MAX, and at least one */
  if (most > STAT_THREADS_MAX) most = STAT_THREADS_MAX;
  if (threads > most) threads = (int)most;
  if (threads < 1) threads = 1;
  stat_job jobs[STAT_THREADS_MAX];
  pthread_t ids[STAT_THREADS_MAX];
  int started[STAT_THREADS_MAX] = {0};
  Py_BEGIN_ALLOW_THREADS for (int t = 0; t < threads; t++) {
    jobs[t] = (stat_job){paths,      sizes.buf,         mtimes.buf,
                         errnos.buf, ctimes.buf,        inodes.buf,
                         n * t / threads, n * (t + 1) / threads};
    /* the first range runs on this thread; a thread that cannot start leaves its range to this one */
    started[t] = t > 0 && pthread_create(&ids[t], NULL, stat_range, &jobs[t]) == 0;
  }
  for (int t = 0; t < threads; t++)
    if (!started[t]) stat_range(&jobs[t]);
  for (int t = 0; t < threads; t++)
    if (started[t]) pthread_join(ids[t], NULL);
  Py_END_ALLOW_THREADS result = Py_None;
  Py_INCREF(result);
done:
  free(paths);
  Py_DECREF(held);
  if (sizes.obj) PyBuffer_Release(&sizes);
  if (mtimes.obj) PyBuffer_Release(&mtimes);
  if (errnos.obj) PyBuffer_Release(&errnos);
  if (ctimes.obj) PyBuffer_Release(&ctimes);
  if (inodes.obj) PyBuffer_Release(&inodes);
  return result;
}

static PyObject *py_buffers_kept(PyObject *self, PyObject *args) {
  return PyLong_FromLongLong(__atomic_load_n(&arenas_kept, __ATOMIC_RELAXED));
}

static PyObject *py_zstd_contexts(PyObject *self, PyObject *args) {
  return PyLong_FromLongLong(__atomic_load_n(&zstd_contexts, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"read", py_read, METH_VARARGS, "read(fds, begins, ends, check, max_gap) -> list[bytes]"},
    {"plan_spans", py_plan_spans, METH_VARARGS,
     "plan_spans(fds, begins, ends, max_gap, span_of_out, waste=-1) -> spans"},
    {"decode", py_decode, METH_VARARGS, "decode(buffers, fds, begins, ends, check, max_gap) -> list[bytes]"},
    {"decode_chunk", py_decode_chunk, METH_VARARGS,
     "decode_chunk(data, position, check, max_records) -> (sizes, values)"},
    {"locate", py_locate, METH_VARARGS, "locate(index, info, shards, locals, begins_out, ends_out)"},
    {"ef_encode", py_ef_encode, METH_VARARGS, "ef_encode(values, sample) -> (l, samples, highs, lows)"},
    {"footer_offsets", py_footer_offsets, METH_VARARGS,
     "footer_offsets(sizes, values, footer_offset, group) -> (offsets, counts, records)"},
    {"stat_paths", py_stat_paths, METH_VARARGS,
     "stat_paths(paths, sizes_out, mtimes_ns_out, errnos_out, threads, ctimes_ns_out, inodes_out)"},
    {"buffers_kept", py_buffers_kept, METH_NOARGS, "buffers_kept() -> read buffers kept by threads now"},
    {"zstd_contexts", py_zstd_contexts, METH_NOARGS, "zstd_contexts() -> zstd contexts kept by threads now"},
    {"hash64", py_hash64, METH_VARARGS, "hash64(data, portable=False): HighwayHash-64 with riegeli's key"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_riegeli", "ArrayRecord chunks read in C.", -1, methods};

PyMODINIT_FUNC PyInit__riegeli(void) {
  const uint16_t probe = 1;
  if (*(const uint8_t *)&probe != 1) {
    PyErr_SetString(PyExc_ImportError, "loader.format._riegeli reads little-endian files on little-endian hosts only");
    return NULL;
  }
  if (pthread_key_create(&arena_key, arena_release)) {
    PyErr_SetString(PyExc_ImportError, "loader.format._riegeli: no thread-specific key left for the read buffers");
    return NULL;
  }
  PyObject *m = PyModule_Create(&module);
  if (!m) return NULL;
  CorruptError = PyErr_NewException("loader.format._riegeli.CorruptError", PyExc_ValueError, NULL);
  UnsupportedError = PyErr_NewException("loader.format._riegeli.UnsupportedError", PyExc_NotImplementedError, NULL);
  TooLargeError = PyErr_NewException("loader.format._riegeli.TooLargeError", PyExc_ValueError, NULL);
  PyModule_AddObject(m, "TooLargeError", TooLargeError);
  Py_INCREF(TooLargeError);
  PyModule_AddObject(m, "CorruptError", CorruptError);
  Py_INCREF(CorruptError);
  PyModule_AddObject(m, "UnsupportedError", UnsupportedError);
  Py_INCREF(UnsupportedError);
  PyModule_AddIntConstant(m, "HAS_ZSTD", zstd_load() == 0);
#ifdef HH_HAVE_AVX2
  __builtin_cpu_init();
  use_avx2 = __builtin_cpu_supports("avx2") != 0;
#endif
  PyModule_AddIntConstant(m, "HASH_AVX2", use_avx2);
  return m;
}
