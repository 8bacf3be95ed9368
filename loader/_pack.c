/* The packer of loader/packing.py: one block of documents laid out into rows of seq_len targets.

   pack(targets, seq_len, window, best_fit, docs, starts, lengths, row_ends) -> rows

   targets: int64[D], the targets of each document of the block in the epoch's order. Each document is cut into
   pieces of at most seq_len targets; each piece goes into one of the `window` newest rows that has room (the oldest
   such row: first fit; the fullest: best fit; ties to the oldest), else into a new row (the oldest open row then
   closes). The pieces come out ordered by row, in the order they were placed: docs[p] (the document's position in
   the block), starts[p] (its first target), lengths[p], and row_ends[r] the end of row r's pieces. The outputs must
   hold the block's pieces (sum of ceil(targets / seq_len)); with docs=None only the number of rows is computed.

   Everything here is a pure function of its inputs: the same block gives the same rows on every host. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_WINDOW 4096

typedef struct {
    int64_t row;
    int64_t free;
} Open;

/* The number of pieces of the block, or -1 (error set) if a target count is negative or the sum overflows. */
static int64_t count_pieces(const int64_t *targets, Py_ssize_t d, int64_t seq_len) {
    int64_t pieces = 0;
    for (Py_ssize_t i = 0; i < d; i++) {
        int64_t t = targets[i];
        if (t < 0) {
            PyErr_Format(PyExc_ValueError, "document %zd of the block has %lld targets (negative)", i, (long long)t);
            return -1;
        }
        int64_t p = t / seq_len + (t % seq_len != 0);
        if (p > INT64_MAX - pieces) {
            PyErr_SetString(PyExc_OverflowError, "the block's pieces overflow int64");
            return -1;
        }
        pieces += p;
    }
    return pieces;
}

/* Places every piece; writes each piece's row into piece_row (when not NULL). Returns the number of rows. */
static int64_t place(const int64_t *targets, Py_ssize_t d, int64_t seq_len, int window, int best_fit,
                     int64_t *piece_row) {
    Open open[MAX_WINDOW];
    int nopen = 0;
    int64_t rows = 0, p = 0;
    for (Py_ssize_t i = 0; i < d; i++) {
        int64_t total = targets[i];
        for (int64_t start = 0; start < total; start += seq_len) {
            int64_t n = total - start < seq_len ? total - start : seq_len;
            int chosen = -1;
            for (int j = 0; j < nopen; j++) {
                if (open[j].free < n)
                    continue;
                if (!best_fit) {
                    chosen = j;
                    break;
                }
                if (chosen < 0 || open[j].free < open[chosen].free)
                    chosen = j;
            }
            if (chosen < 0) {
                if (nopen == window) { /* the oldest open row closes */
                    memmove(open, open + 1, (size_t)(window - 1) * sizeof(Open));
                    nopen--;
                }
                open[nopen].row = rows++;
                open[nopen].free = seq_len;
                chosen = nopen++;
            }
            open[chosen].free -= n;
            if (piece_row)
                piece_row[p] = open[chosen].row;
            p++;
        }
    }
    return rows;
}

static int writable_int64(Py_buffer *b, const char *name, int64_t need) {
    if (b->itemsize != 8 || b->len / 8 < need) {
        PyErr_Format(PyExc_ValueError, "%s must be a writable int64 buffer of at least %lld items", name,
                     (long long)need);
        return 0;
    }
    return 1;
}

static PyObject *pack(PyObject *self, PyObject *args) {
    Py_buffer targets = {0}, docs = {0}, starts = {0}, lengths = {0}, row_ends = {0};
    PyObject *docs_obj, *starts_obj, *lengths_obj, *ends_obj;
    long long seq_len;
    int window, best_fit;
    if (!PyArg_ParseTuple(args, "y*LipOOOO", &targets, &seq_len, &window, &best_fit, &docs_obj, &starts_obj,
                          &lengths_obj, &ends_obj))
        return NULL;
    PyObject *result = NULL;
    int64_t *piece_row = NULL;
    int have_out = docs_obj != Py_None;
    if (targets.itemsize != 1 || targets.len % 8) {
        PyErr_SetString(PyExc_ValueError, "targets must be int64 bytes");
        goto done;
    }
    if (seq_len < 1 || window < 1 || window > MAX_WINDOW) {
        PyErr_Format(PyExc_ValueError, "seq_len must be >= 1 and window in [1, %d] (got %lld, %d)", MAX_WINDOW,
                     seq_len, window);
        goto done;
    }
    const int64_t *t = (const int64_t *)targets.buf;
    Py_ssize_t d = targets.len / 8;
    int64_t pieces = count_pieces(t, d, seq_len);
    if (pieces < 0)
        goto done;
    if (!have_out) {
        int64_t rows;
        Py_BEGIN_ALLOW_THREADS
        rows = place(t, d, seq_len, window, best_fit, NULL);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLongLong(rows);
        goto done;
    }
    if (PyObject_GetBuffer(docs_obj, &docs, PyBUF_WRITABLE | PyBUF_FORMAT) < 0 ||
        PyObject_GetBuffer(starts_obj, &starts, PyBUF_WRITABLE | PyBUF_FORMAT) < 0 ||
        PyObject_GetBuffer(lengths_obj, &lengths, PyBUF_WRITABLE | PyBUF_FORMAT) < 0 ||
        PyObject_GetBuffer(ends_obj, &row_ends, PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        goto done;
    if (!writable_int64(&docs, "docs", pieces) || !writable_int64(&starts, "starts", pieces) ||
        !writable_int64(&lengths, "lengths", pieces) || !writable_int64(&row_ends, "row_ends", pieces))
        goto done;
    if ((uint64_t)pieces > SIZE_MAX / sizeof(int64_t) - 1) {
        PyErr_NoMemory();
        goto done;
    }
    piece_row = PyMem_RawMalloc((size_t)(pieces ? pieces : 1) * sizeof(int64_t));
    if (!piece_row) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t rows;
    int64_t *out_doc = docs.buf, *out_start = starts.buf, *out_len = lengths.buf, *ends = row_ends.buf;
    Py_BEGIN_ALLOW_THREADS
    rows = place(t, d, seq_len, window, best_fit, piece_row);
    /* A counting sort of the pieces by row, stable: ends[r] first counts row r's pieces, then is its end. */
    memset(ends, 0, (size_t)rows * sizeof(int64_t));
    for (int64_t p = 0; p < pieces; p++)
        ends[piece_row[p]]++;
    int64_t at = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t c = ends[r];
        ends[r] = at; /* for now: where row r's pieces begin */
        at += c;
    }
    int64_t p = 0;
    for (Py_ssize_t i = 0; i < d; i++) {
        for (int64_t start = 0; start < t[i]; start += seq_len, p++) {
            int64_t slot = ends[piece_row[p]]++;
            out_doc[slot] = i;
            out_start[slot] = start;
            out_len[slot] = t[i] - start < seq_len ? t[i] - start : seq_len;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(rows); /* ends[r] is now the end of row r's pieces */
done:
    PyMem_RawFree(piece_row);
    PyBuffer_Release(&targets);
    if (docs.obj)
        PyBuffer_Release(&docs);
    if (starts.obj)
        PyBuffer_Release(&starts);
    if (lengths.obj)
        PyBuffer_Release(&lengths);
    if (row_ends.obj)
        PyBuffer_Release(&row_ends);
    return result;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS,
     "pack(targets: bytes of int64, seq_len, window, best_fit, docs, starts, lengths, row_ends) -> rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
