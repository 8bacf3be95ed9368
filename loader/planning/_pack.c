/* The packer of loader/planning/packing.py: one block of documents laid out into rows of seq_len targets.

   pack(targets, seq_len, window, best_fit, docs, starts, lengths, first_rows, row_counts) -> (rows, segments)

   targets: int64[D], the targets of each document of the block in the epoch's order. Each document is cut into
   pieces of at most seq_len targets; each piece goes into one of the `window` newest rows that has room (the oldest
   such row: first fit; the fullest: best fit; ties to the oldest), else into a new row (the oldest open row then
   closes).

   A piece of exactly seq_len targets always opens a new row and fills it, so a document's full pieces make a run of
   consecutive rows, kept as one segment. The work and memory of a block are therefore bounded by its number of
   documents (at most 2 segments each, O(window) steps each), whatever the targets say: a damaged or crafted count of
   billions of targets costs what a count of one does (the loader finds the lie when it reads the record).

   The segments come out ordered by row, in the order they were placed: docs[s] (the document's position in the
   block), starts[s] (its first target), lengths[s] (its targets; for a run, each row's), first_rows[s] and
   row_counts[s] (a run's rows, else 1; several segments can share a row). The outputs must hold 2 * D items. With
   docs=None only the number of rows is computed, and returned alone.

   Everything here is a pure function of its inputs: the same block gives the same rows on every host. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_WINDOW 4096

typedef struct {
    int64_t row;
    int64_t free;
    int64_t group; /* its row group: a run of full rows, or one row */
} Open;

typedef struct {
    int64_t *doc, *start, *len, *group; /* per segment, in placement order */
    int64_t *group_row, *group_rows;     /* per row group; groups are numbered in row order */
} Placed;

enum { PLACED, NEGATIVE_TARGET, TOO_MANY_ROWS };

/* Places every piece of the block; fills `out` unless it is NULL. Returns PLACED with *rows and *segments set, or
   NEGATIVE_TARGET (*rows: the document) or TOO_MANY_ROWS. Needs no GIL. */
static int place(const int64_t *targets, Py_ssize_t d, int64_t seq_len, int window, int best_fit, Placed *out,
                 int64_t *rows_out, int64_t *segments_out) {
    Open open[MAX_WINDOW];
    int nopen = 0;
    int64_t rows = 0, segments = 0, groups = 0;
    for (Py_ssize_t i = 0; i < d; i++) {
        int64_t total = targets[i];
        if (total < 0) {
            *rows_out = i;
            return NEGATIVE_TARGET;
        }
        int64_t full = total / seq_len, rest = total % seq_len;
        if (full > 0) {
            if (full > INT64_MAX - 1 - rows)
                return TOO_MANY_ROWS;
            /* as `full` new rows, one piece each: the oldest open rows close and the run's newest rows, full, stay */
            int stay = full < window ? (int)full : window;
            if (nopen + stay > window) {
                int drop = nopen + stay - window;
                memmove(open, open + drop, (size_t)(nopen - drop) * sizeof(Open));
                nopen -= drop;
            }
            for (int j = 0; j < stay; j++, nopen++) {
                open[nopen].row = rows + full - stay + j;
                open[nopen].free = 0;
                open[nopen].group = groups;
            }
            if (out) {
                out->group_row[groups] = rows;
                out->group_rows[groups] = full;
                out->doc[segments] = i;
                out->start[segments] = 0;
                out->len[segments] = seq_len;
                out->group[segments] = groups;
            }
            groups++;
            segments++;
            rows += full;
        }
        if (rest == 0)
            continue;
        int chosen = -1;
        for (int j = 0; j < nopen; j++) {
            if (open[j].free < rest)
                continue;
            if (!best_fit) {
                chosen = j;
                break;
            }
            if (chosen < 0 || open[j].free < open[chosen].free)
                chosen = j;
        }
        if (chosen < 0) {
            if (rows == INT64_MAX)
                return TOO_MANY_ROWS;
            if (nopen == window) { /* the oldest open row closes */
                memmove(open, open + 1, (size_t)(window - 1) * sizeof(Open));
                nopen--;
            }
            open[nopen].row = rows;
            open[nopen].free = seq_len;
            open[nopen].group = groups;
            if (out) {
                out->group_row[groups] = rows;
                out->group_rows[groups] = 1;
            }
            groups++;
            rows++;
            chosen = nopen++;
        }
        open[chosen].free -= rest;
        if (out) {
            out->doc[segments] = i;
            out->start[segments] = full * seq_len; /* full * seq_len <= total: no overflow */
            out->len[segments] = rest;
            out->group[segments] = open[chosen].group;
        }
        segments++;
    }
    *rows_out = rows;
    *segments_out = segments;
    return PLACED;
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
    static const char *names[5] = {"docs", "starts", "lengths", "first_rows", "row_counts"};
    Py_buffer targets = {0}, bufs[5];
    PyObject *objs[5];
    long long seq_len;
    int window, best_fit;
    memset(bufs, 0, sizeof(bufs));
    if (!PyArg_ParseTuple(args, "y*LipOOOOO", &targets, &seq_len, &window, &best_fit, &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4]))
        return NULL;
    PyObject *result = NULL;
    int64_t *scratch = NULL;
    int have_out = objs[0] != Py_None, placed;
    int64_t rows = 0, segments = 0;
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
    int64_t need = 2 * (int64_t)d; /* d <= PY_SSIZE_T_MAX / 8: 6 * need * 8 bytes cannot overflow */
    if (!have_out) {
        Py_BEGIN_ALLOW_THREADS
        placed = place(t, d, seq_len, window, best_fit, NULL, &rows, &segments);
        Py_END_ALLOW_THREADS
    } else {
        for (int k = 0; k < 5; k++)
            if (PyObject_GetBuffer(objs[k], &bufs[k], PyBUF_WRITABLE | PyBUF_FORMAT) < 0 ||
                !writable_int64(&bufs[k], names[k], need))
                goto done;
        scratch = PyMem_RawMalloc((size_t)(need ? 6 * need : 1) * sizeof(int64_t));
        if (!scratch) {
            PyErr_NoMemory();
            goto done;
        }
        Placed p = {scratch, scratch + need, scratch + 2 * need, scratch + 3 * need, scratch + 4 * need,
                    scratch + 5 * need};
        int64_t *doc = bufs[0].buf, *start = bufs[1].buf, *len = bufs[2].buf, *first = bufs[3].buf,
                *count = bufs[4].buf;
        Py_BEGIN_ALLOW_THREADS
        placed = place(t, d, seq_len, window, best_fit, &p, &rows, &segments);
        if (placed == PLACED) {
            /* a stable counting sort of the segments by group (groups are in row order): count[g] first counts
               group g's segments, then is where they go */
            int64_t groups = 0;
            for (int64_t s = 0; s < segments; s++)
                groups = p.group[s] + 1 > groups ? p.group[s] + 1 : groups;
            memset(count, 0, (size_t)(groups ? groups : 1) * sizeof(int64_t));
            for (int64_t s = 0; s < segments; s++)
                count[p.group[s]]++;
            int64_t at = 0;
            for (int64_t g = 0; g < groups; g++) {
                int64_t c = count[g];
                count[g] = at;
                at += c;
            }
            for (int64_t s = 0; s < segments; s++) {
                int64_t slot = count[p.group[s]]++;
                doc[slot] = p.doc[s];
                start[slot] = p.start[s];
                len[slot] = p.len[s];
                first[slot] = p.group[s]; /* for now: its group */
            }
            for (int64_t slot = 0; slot < segments; slot++) {
                int64_t g = first[slot];
                first[slot] = p.group_row[g];
                count[slot] = p.group_rows[g];
            }
        }
        Py_END_ALLOW_THREADS
    }
    if (placed == NEGATIVE_TARGET)
        PyErr_Format(PyExc_ValueError, "document %lld of the block has %lld targets (negative)", (long long)rows,
                     (long long)t[rows]);
    else if (placed == TOO_MANY_ROWS)
        PyErr_SetString(PyExc_OverflowError, "the block's rows overflow int64");
    else
        result = have_out ? Py_BuildValue("LL", (long long)rows, (long long)segments) : PyLong_FromLongLong(rows);
done:
    PyMem_RawFree(scratch);
    PyBuffer_Release(&targets);
    for (int k = 0; k < 5; k++)
        if (bufs[k].obj)
            PyBuffer_Release(&bufs[k]);
    return result;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_VARARGS,
     "pack(targets: bytes of int64, seq_len, window, best_fit, docs, starts, lengths, first_rows, row_counts) -> "
     "(rows, segments); with docs=None -> rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
