/* JPEG crop decode with libjpeg(-turbo), the GIL released: only the crop's rows and (iMCU-aligned) columns are
 * inverse-transformed and colour-converted (the rows around them are entropy-decoded only, to the end marker, so
 * that data corrupt anywhere is an error here as in a whole decode), and the DCT scales down (n/8) when
 * the crop is larger than it needs to be (by 1/2, 1/4 or 1/8). tf.image.decode_and_crop_jpeg does the same.
 *
 * crop(data, top, left, height, width, min_height, min_width, max_pixels)
 *   -> (pixels: bytes, rows, cols, x_offset, scale_num)
 * `pixels` holds rows x cols RGB pixels; the crop's columns start at x_offset within them (libjpeg widens a column
 * range to whole iMCUs). The box is in full-size pixels; the image decodes at scale n/8 (the smallest n of 8, 4, 2, 1
 * whose crop is at least min_height x min_width), and the box is scaled with it (rounded outwards).
 * Raises ValueError for data libjpeg rejects or warns about (a truncated or corrupt JPEG is never padded with grey) and
 * for a header declaring more than max_pixels pixels, NotImplementedError for colour spaces it does not convert to RGB
 * (CMYK/YCCK).
 *
 * Hostile headers: libjpeg allocates for the declared size, not for the data behind it (a progressive JPEG's whole
 * coefficient buffer at jpeg_start_decompress, even for a crop: 239 bytes declaring 30000x30000 took 2.6 GB). So the
 * declared pixels are checked right after jpeg_read_header, and libjpeg's own memory limit is set from max_pixels, so
 * that nothing it allocates outgrows an image at the cap. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

/* The smallest vertical DCT scale of any component: one field before libjpeg 7's API (libjpeg-turbo's default build),
 * a horizontal and a vertical one from it on (libjpeg-turbo built --with-jpeg7/8, as some distributions and CUDA
 * images ship it). */
#if JPEG_LIB_VERSION >= 70
#define MIN_DCT_V_SCALED_SIZE(cinfo) ((cinfo).min_DCT_v_scaled_size)
#else
#define MIN_DCT_V_SCALED_SIZE(cinfo) ((cinfo).min_DCT_scaled_size)
#endif

/* The most libjpeg holds for an image of n pixels: a progressive decode's coefficients, 2 bytes each, 64 a block of
 * 8x8 pixels, for up to 3 components (libjpeg converts no more to RGB) = 6 bytes a pixel, rounded up to 8 for blocks
 * padded to whole MCUs; plus rows and tables (a row buffer of a 65,535-pixel-wide image is a few MB). */
#define BYTES_A_PIXEL 8
#define MEMORY_BESIDES (32L << 20)

static long memory_limit(unsigned long long max_pixels) {
  if (max_pixels > (unsigned long long)(LONG_MAX - MEMORY_BESIDES) / BYTES_A_PIXEL) return LONG_MAX;
  return (long)max_pixels * BYTES_A_PIXEL + MEMORY_BESIDES;
}

struct error_mgr {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  int warnings;
  char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
  struct error_mgr *err = (struct error_mgr *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
  struct error_mgr *err = (struct error_mgr *)cinfo->err;
  if (level < 0 && !err->warnings) { /* a warning: corrupt data libjpeg would paper over */
    err->warnings = 1;
    (*cinfo->err->format_message)(cinfo, err->message);
  }
}

/* The most scans a JPEG may have. A progressive JPEG has ~10 (mozjpeg's under 20); each scan walks every block of
 * its components, and libjpeg takes any number of them without a warning, so 4,000 scans of 40 bytes cost 12 s of CPU
 * a decode of a 4096x4096 image. libjpeg-turbo's own advice for data one does not trust: a scan limit (djpeg
 * -maxscans, TurboJPEG's TJPARAM_SCANLIMIT), checked by a progress monitor as djpeg does. loader/decoding/images.py's
 * MAX_SCANS is the same. */
#define MAX_SCANS 200

static void on_progress(j_common_ptr cinfo) {
  if (cinfo->is_decompressor && ((j_decompress_ptr)cinfo)->input_scan_number > MAX_SCANS) {
    struct error_mgr *err = (struct error_mgr *)cinfo->err;
    snprintf(err->message, sizeof err->message,
             "more than %d scans (a progressive JPEG has ~10; each scan decodes every block again: a CPU bomb?)",
             MAX_SCANS);
    longjmp(err->jump, 1);
  }
}

static unsigned scaled_floor(unsigned v, unsigned n) { return v * n / 8; }
static unsigned scaled_ceil(unsigned v, unsigned n) { return (v * n + 7) / 8; }

static PyObject *py_crop(PyObject *self, PyObject *args) {
  Py_buffer data;
  unsigned top, left, height, width, min_height, min_width;
  unsigned long long max_pixels;
  if (!PyArg_ParseTuple(args, "y*IIIIIIK", &data, &top, &left, &height, &width, &min_height, &min_width, &max_pixels))
    return NULL;
  struct jpeg_decompress_struct cinfo;
  struct error_mgr err;
  memset(&err, 0, sizeof err);
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = on_error;
  err.pub.emit_message = on_message;
  unsigned char *volatile out = NULL, *volatile last = NULL; /* (volatile: libjpeg's errors longjmp past them) */
  volatile int unsupported = 0, failed = 0, too_large = 0;
  unsigned rows = 0, cols = 0, x_offset = 0, n = 8, full_h = 0, full_w = 0;
  Py_BEGIN_ALLOW_THREADS
  jpeg_create_decompress(&cinfo);
  struct jpeg_progress_mgr progress;
  memset(&progress, 0, sizeof progress);
  progress.progress_monitor = on_progress;
  cinfo.progress = &progress;
  cinfo.mem->max_memory_to_use = memory_limit(max_pixels); /* beyond it: "Backing store not supported", an error */
  if (setjmp(err.jump)) {
    failed = 1;
  } else {
    jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
    jpeg_read_header(&cinfo, TRUE);
    full_h = cinfo.image_height, full_w = cinfo.image_width;
    if (width == 0 || height == 0) top = left = 0, height = full_h, width = full_w;
    if ((unsigned long long)full_h * full_w > max_pixels) {
      too_large = 1;
    } else if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
      unsupported = 1;
    } else if (height > full_h || top > full_h - height || width > full_w || left > full_w - width) {
      snprintf(err.message, sizeof err.message, "crop box (%u, %u, %u, %u) is outside the %ux%u image", top, left,
               height, width, full_h, full_w);
      failed = 1;
    } else {
      /* Only 1/2, 1/4, 1/8: libjpeg-turbo's other scales (3/8, 5/8 ...) take a slow IDCT, slower than a full one. */
      while (n > 1 && scaled_floor(height, n / 2) >= min_height && scaled_floor(width, n / 2) >= min_width) n /= 2;
      cinfo.scale_num = n;
      cinfo.scale_denom = 8;
      cinfo.out_color_space = JCS_RGB;
      cinfo.dct_method = JDCT_IFAST;
      cinfo.do_fancy_upsampling = FALSE;
      jpeg_start_decompress(&cinfo);
      unsigned y0 = scaled_floor(top, n), y1 = scaled_ceil(top + height, n);
      unsigned x0 = scaled_floor(left, n), x1 = scaled_ceil(left + width, n);
      if (y1 > cinfo.output_height) y1 = cinfo.output_height;
      if (x1 > cinfo.output_width) x1 = cinfo.output_width;
      if (y1 <= y0) y1 = y0 + 1;
      if (x1 <= x0) x1 = x0 + 1;
      JDIMENSION xoff = x0, cw = x1 - x0;
      if (xoff > 0 || cw < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &cw);
      x_offset = x0 - xoff;
      cols = cw;
      rows = y1 - y0;
      out = malloc((size_t)rows * cols * 3);
      if (!out) {
        snprintf(err.message, sizeof err.message, "out of memory for a %ux%u crop", rows, cols);
        failed = 1;
      } else {
        if (y0 > 0) jpeg_skip_scanlines(&cinfo, y0);
        while (cinfo.output_scanline < y1) {
          JSAMPROW row = out + (size_t)(cinfo.output_scanline - y0) * cols * 3;
          jpeg_read_scanlines(&cinfo, &row, 1);
        }
        /* The rows below the crop are entropy-decoded too (skipped short of the last one, which is read: a skip to
         * the end returns without reading), and the decode finished, so that libjpeg reaches the end marker: data
         * corrupted mid-scan shows there ("N extraneous bytes before marker 0xd9"); a decode stopped at the crop's
         * last row returned its wrong pixels without a word. No inverse transform is spent on the skipped rows. */
        /* output rows an iMCU row */
        unsigned imcu = (unsigned)(cinfo.max_v_samp_factor * MIN_DCT_V_SCALED_SIZE(cinfo));
        if (cinfo.output_scanline < cinfo.output_height) {
          last = malloc((size_t)cols * 3);
          if (!last) {
            snprintf(err.message, sizeof err.message, "out of memory for a %u-pixel row", cols);
            failed = 1;
          } else {
            JSAMPROW row = last;
            while (cinfo.output_scanline < cinfo.output_height && cinfo.output_scanline % imcu)
              jpeg_read_scanlines(&cinfo, &row, 1);
            unsigned below = cinfo.output_height - cinfo.output_scanline;
            if (below > 2 * imcu) jpeg_skip_scanlines(&cinfo, below - below % imcu - imcu);
            while (cinfo.output_scanline < cinfo.output_height) jpeg_read_scanlines(&cinfo, &row, 1);
          }
        }
        if (!failed) jpeg_finish_decompress(&cinfo);
        if (err.warnings) failed = 1;
      }
    }
  }
  jpeg_destroy_decompress(&cinfo); /* also after an abandoned decode: libjpeg frees its own memory */
  free(last);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&data);
  if (too_large) {
    free(out);
    PyErr_Format(PyExc_ValueError,
                 "an image declaring %ux%u = %llu pixels, over max_pixels=%llu (a decompression bomb?); pass a larger "
                 "max_pixels= to the image op if your images really are this large",
                 full_h, full_w, (unsigned long long)full_h * full_w, max_pixels);
    return NULL;
  }
  if (unsupported) {
    free(out);
    PyErr_SetString(PyExc_NotImplementedError, "a CMYK/YCCK JPEG: libjpeg does not convert it to RGB");
    return NULL;
  }
  if (failed) {
    free(out);
    PyErr_Format(PyExc_ValueError, "not a JPEG that decodes: %s", err.message);
    return NULL;
  }
  PyObject *pixels = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)rows * cols * 3);
  free(out);
  if (!pixels) return NULL;
  return Py_BuildValue("(NIIII)", pixels, rows, cols, x_offset, n);
}

static PyMethodDef methods[] = {
    {"crop", py_crop, METH_VARARGS,
     "crop(data, top, left, height, width, min_height, min_width, max_pixels)\n"
     "  -> (pixels, rows, cols, x_offset, scale_num)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpeg", "JPEG crop decode with libjpeg.", -1, methods};

PyMODINIT_FUNC PyInit__jpeg(void) { return PyModule_Create(&module); }
