/* kvguard._native.digest: value fingerprints of CPU tensors in one pass over raw memory.
 *
 * digest(specs) -> list[int | None]
 *   `specs` is a list of (storage_ptr, storage_nbytes, storage_offset, itemsize, sizes,
 *   strides) tuples, offset and strides in elements (never negative in PyTorch). A
 *   tensor whose elements do not all lie inside its storage (a storage freed with
 *   `resize_(0)`, a subclass without real memory) gets None: nothing is read outside
 *   the storage. For the others, a 64-bit digest of the element
 *   bytes in logical (row-major) order: order-sensitive (swapping two different
 *   elements changes it), of raw bits (an untouched NaN is no change), for any dtype.
 *   The bytes are hashed as one stream in logical order, 64 at a time in eight
 *   independent lanes (see `acc_t`), so the loop runs at memory speed and the digest depends on the
 *   values and the shape only, not on the memory layout (a transposed copy of equal
 *   values has the same digest). No copy of the tensor is made; strided rows are
 *   gathered through a 4 KB buffer. The GIL is released while hashing.
 *
 * Not cryptographic: it finds accidental writes, not crafted collisions. The caller
 * keeps the tensors alive for the duration of the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DIMS 64
#define PRIME 0x9E3779B97F4A7C15ULL
#define PRIME32 0x9E3779B1ULL
#define STRIPE 64          /* bytes: eight 64-bit lanes */
#define STRIPES 16         /* stripes between two scrambles of the lanes */

typedef struct {
    const unsigned char *data;
    int valid;
    Py_ssize_t itemsize;
    int ndim;
    Py_ssize_t sizes[MAX_DIMS];
    Py_ssize_t strides[MAX_DIMS];
    uint64_t result;
} spec_t;

/* A stream over the tensor's element bytes in logical order, 64 bytes (a stripe) at a time:
 * word i of a stripe goes to lane i, `lane += w + lo32(w ^ k) * hi32(w ^ k)` with a key `k`
 * that depends on the lane and on the stripe's place among the STRIPES since the last
 * scramble (so moving a word to another lane or stripe changes the digest), and every
 * STRIPES stripes each lane is scrambled (`a ^= a >> 47; a ^= k; a *= PRIME32`), which makes
 * the order of the groups count too. The additions and 32 x 32-bit products are
 * independent across lanes: the loop runs at memory speed (AVX2 where the CPU has it, the
 * same arithmetic in plain C otherwise; both give the same digest). Bytes short of a
 * stripe wait in `pend` for the next run, so the result depends on the byte sequence only,
 * never on where runs start in memory. Not cryptographic: it finds accidental writes. */
typedef struct {
    uint64_t lane[8];
    uint64_t stripes; /* stripes fed so far */
    uint64_t count;   /* bytes fed so far */
    unsigned char pend[STRIPE];
    size_t npend;
} acc_t;

static uint64_t KEYS[STRIPES * 8 + 8]; /* per (stripe in the group, lane), then the scramble's */

static void init_keys(void)
{
    uint64_t x = 0x243F6A8885A308D3ULL; /* splitmix64 from pi's digits: fixed for every process */
    for (int i = 0; i < STRIPES * 8 + 8; i++) {
        uint64_t z = (x += PRIME);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        KEYS[i] = z ^ (z >> 31);
    }
}

static inline uint64_t mix(uint64_t h, uint64_t w)
{
    h = (h ^ w) * PRIME;
    return h ^ (h >> 29);
}

/* `n` whole stripes from `p`: the reference arithmetic. */
static void stripes_c(acc_t *a, const unsigned char *p, size_t n)
{
    uint64_t lane[8];
    memcpy(lane, a->lane, sizeof lane);
    size_t k = (size_t)(a->stripes % STRIPES);
    for (size_t j = 0; j < n; j++, p += STRIPE) {
        const uint64_t *key = KEYS + k * 8;
        for (int i = 0; i < 8; i++) {
            uint64_t w, x;
            memcpy(&w, p + 8 * i, 8);
            x = w ^ key[i];
            lane[i] += w + (x & 0xFFFFFFFFULL) * (x >> 32);
        }
        if (++k == STRIPES) {
            k = 0;
            for (int i = 0; i < 8; i++) {
                uint64_t v = lane[i];
                v ^= v >> 47;
                v ^= KEYS[STRIPES * 8 + i];
                lane[i] = v * PRIME32;
            }
        }
    }
    memcpy(a->lane, lane, sizeof lane);
    a->stripes += n;
}

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

/* The same arithmetic on two 256-bit registers (lanes 0-3, 4-7). */
__attribute__((target("avx2"))) static void stripes_avx2(acc_t *a, const unsigned char *p, size_t n)
{
    __m256i l0 = _mm256_loadu_si256((const __m256i *)a->lane);
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(a->lane + 4));
    const __m256i p32 = _mm256_set1_epi64x((long long)PRIME32);
    const __m256i s0 = _mm256_loadu_si256((const __m256i *)(KEYS + STRIPES * 8));
    const __m256i s1 = _mm256_loadu_si256((const __m256i *)(KEYS + STRIPES * 8 + 4));
    size_t k = (size_t)(a->stripes % STRIPES);
    for (size_t j = 0; j < n; j++, p += STRIPE) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)p);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        const __m256i x0 = _mm256_xor_si256(w0, _mm256_loadu_si256((const __m256i *)(KEYS + k * 8)));
        const __m256i x1 = _mm256_xor_si256(w1, _mm256_loadu_si256((const __m256i *)(KEYS + k * 8 + 4)));
        l0 = _mm256_add_epi64(l0, _mm256_add_epi64(w0, _mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32))));
        l1 = _mm256_add_epi64(l1, _mm256_add_epi64(w1, _mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32))));
        if (++k == STRIPES) {
            k = 0;
            l0 = _mm256_xor_si256(_mm256_xor_si256(l0, _mm256_srli_epi64(l0, 47)), s0);
            l1 = _mm256_xor_si256(_mm256_xor_si256(l1, _mm256_srli_epi64(l1, 47)), s1);
            /* v * PRIME32 mod 2^64 = lo32(v) * PRIME32 + (hi32(v) * PRIME32) << 32 */
            l0 = _mm256_add_epi64(_mm256_mul_epu32(l0, p32),
                                  _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(l0, 32), p32), 32));
            l1 = _mm256_add_epi64(_mm256_mul_epu32(l1, p32),
                                  _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(l1, 32), p32), 32));
        }
    }
    _mm256_storeu_si256((__m256i *)a->lane, l0);
    _mm256_storeu_si256((__m256i *)(a->lane + 4), l1);
    a->stripes += n;
}
#endif

static void (*stripes)(acc_t *, const unsigned char *, size_t) = stripes_c;

static void feed(acc_t *a, const unsigned char *p, size_t nbytes)
{
    a->count += nbytes;
    if (a->npend) { /* top up the pending stripe first */
        size_t take = STRIPE - a->npend < nbytes ? STRIPE - a->npend : nbytes;
        memcpy(a->pend + a->npend, p, take);
        a->npend += take, p += take, nbytes -= take;
        if (a->npend < STRIPE)
            return;
        stripes(a, a->pend, 1);
        a->npend = 0;
    }
    size_t whole = nbytes / STRIPE;
    if (whole) {
        stripes(a, p, whole);
        p += whole * STRIPE, nbytes -= whole * STRIPE;
    }
    memcpy(a->pend, p, nbytes);
    a->npend = nbytes;
}

static uint64_t finish(acc_t *a)
{
    if (a->npend) {
        memset(a->pend + a->npend, 0, STRIPE - a->npend);
        stripes(a, a->pend, 1);
    }
    uint64_t h = mix(0x13198A2E03707344ULL, a->count);
    for (int i = 0; i < 8; i++)
        h = mix(h, a->lane[i]);
    return h;
}

static uint64_t digest_one(const spec_t *s)
{
    acc_t a = {{0x243F6A8885A308D3ULL, 0x13198A2E03707344ULL, 0xA4093822299F31D0ULL, 0x082EFA98EC4E6C89ULL,
                0x452821E638D01377ULL, 0xBE5466CF34E90C6CULL, 0xC0AC29B7C97C50DDULL, 0x3F84D5B5B5470917ULL},
               0, 0, {0}, 0};
    Py_ssize_t numel = 1;
    for (int d = 0; d < s->ndim; d++)
        numel *= s->sizes[d];
    if (numel > 0) {
        /* The innermost dims that are contiguous in memory form one run of bytes. */
        int inner = s->ndim;
        Py_ssize_t run = 1;
        while (inner > 0 && (s->sizes[inner - 1] == 1 || s->strides[inner - 1] == run)) {
            run *= s->sizes[inner - 1];
            inner--;
        }
        size_t run_bytes = (size_t)run * (size_t)s->itemsize;
        Py_ssize_t index[MAX_DIMS] = {0};
        Py_ssize_t runs = numel / run;
        /* Runs of one element (a strided last dim): gather that dim through a small buffer. */
        int by_element = run == 1 && inner > 0;
        int outer = by_element ? inner - 1 : inner;
        Py_ssize_t steps = by_element ? s->sizes[inner - 1] : 1;
        Py_ssize_t step = by_element ? s->strides[inner - 1] * s->itemsize : 0;
        unsigned char gathered[4096];
        size_t per_batch = sizeof gathered / (size_t)s->itemsize;
        for (Py_ssize_t r = 0; r < runs; r += steps) {
            Py_ssize_t offset = 0;
            for (int d = 0; d < outer; d++)
                offset += index[d] * s->strides[d];
            const unsigned char *p = s->data + offset * s->itemsize;
            if (by_element && per_batch > 0) {
                for (Py_ssize_t i = 0; i < steps;) {
                    size_t n = 0;
                    for (; n < per_batch && i < steps; n++, i++, p += step)
                        memcpy(gathered + n * (size_t)s->itemsize, p, (size_t)s->itemsize);
                    feed(&a, gathered, n * (size_t)s->itemsize);
                }
            }
            else if (by_element) { /* an element larger than the buffer */
                for (Py_ssize_t i = 0; i < steps; i++, p += step)
                    feed(&a, p, (size_t)s->itemsize);
            }
            else
                feed(&a, p, run_bytes);
            for (int d = outer - 1; d >= 0; d--) { /* next outer index, last dim fastest */
                if (++index[d] < s->sizes[d])
                    break;
                index[d] = 0;
            }
        }
    }
    uint64_t h = finish(&a);
    for (int d = 0; d < s->ndim; d++)
        h = mix(h, (uint64_t)s->sizes[d]);
    return h;
}

static int parse_dims(PyObject *seq, Py_ssize_t *out, int ndim)
{
    for (int d = 0; d < ndim; d++) {
        out[d] = PyLong_AsSsize_t(PyTuple_GET_ITEM(seq, d));
        if (out[d] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static PyObject *digest(PyObject *self, PyObject *args)
{
    PyObject *specs;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &specs))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(specs);
    spec_t *parsed = PyMem_Calloc(n ? n : 1, sizeof(spec_t));
    if (parsed == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ptr, *sizes, *strides;
        Py_ssize_t nbytes, offset;
        spec_t *s = &parsed[i];
        if (!PyArg_ParseTuple(PyList_GET_ITEM(specs, i), "OnnnO!O!", &ptr, &nbytes, &offset, &s->itemsize,
                              &PyTuple_Type, &sizes, &PyTuple_Type, &strides))
            goto fail;
        const unsigned char *base = PyLong_AsVoidPtr(ptr);
        if (base == NULL && PyErr_Occurred())
            goto fail;
        Py_ssize_t ndim = PyTuple_GET_SIZE(sizes);
        if (ndim > MAX_DIMS || PyTuple_GET_SIZE(strides) != ndim || s->itemsize <= 0) {
            PyErr_SetString(PyExc_ValueError, "digest(): bad tensor spec");
            goto fail;
        }
        s->ndim = (int)ndim;
        if (parse_dims(sizes, s->sizes, s->ndim) < 0 || parse_dims(strides, s->strides, s->ndim) < 0)
            goto fail;
        /* The last byte any element reaches must lie inside the storage. */
        Py_ssize_t numel = 1, reach = offset;
        for (int d = 0; d < s->ndim; d++) {
            if (s->sizes[d] < 0 || s->strides[d] < 0 || offset < 0) {
                PyErr_SetString(PyExc_ValueError, "digest(): negative size, stride or offset");
                goto fail;
            }
            numel *= s->sizes[d];
            reach += (s->sizes[d] ? s->sizes[d] - 1 : 0) * s->strides[d];
        }
        s->valid = numel == 0 || (base != NULL && (reach + 1) * s->itemsize <= nbytes);
        s->data = base + offset * s->itemsize;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        if (parsed[i].valid)
            parsed[i].result = digest_one(&parsed[i]);
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = parsed[i].valid ? PyLong_FromUnsignedLongLong(parsed[i].result) : Py_NewRef(Py_None);
        if (value == NULL) {
            Py_DECREF(out);
            goto fail;
        }
        PyList_SET_ITEM(out, i, value);
    }
    PyMem_Free(parsed);
    return out;
fail:
    PyMem_Free(parsed);
    return NULL;
}

/* For kvguard._native.write_hook's describe(): the same digest of one strided tensor, so a digest
 * taken there and one taken here always agree. `data` points at the first element; the
 * caller has checked that every element lies inside readable memory. */
static uint64_t digest_strided(const unsigned char *data, Py_ssize_t itemsize, int ndim, const Py_ssize_t *sizes,
                               const Py_ssize_t *strides)
{
    spec_t s;
    if (ndim > MAX_DIMS || itemsize <= 0)
        return 0;
    s.data = data, s.valid = 1, s.itemsize = itemsize, s.ndim = ndim, s.result = 0;
    for (int d = 0; d < ndim; d++)
        s.sizes[d] = sizes[d], s.strides[d] = strides[d];
    return digest_one(&s);
}

/* The capsule `kvguard._native.digest._api` holds this: a version, the dims limit and the function. */
typedef struct {
    int version;
    int max_dims;
    uint64_t (*digest_strided)(const unsigned char *, Py_ssize_t, int, const Py_ssize_t *, const Py_ssize_t *);
} kvguard_digest_api;

static kvguard_digest_api api = {1, MAX_DIMS, digest_strided};

/* _path(name=None) -> str: the stripe loop in use ("avx2" or "c"); `name` switches to it (tests
 * compare the two). */
static PyObject *path(PyObject *self, PyObject *args)
{
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name))
        return NULL;
#ifdef HAVE_AVX2_PATH
    const char *now = stripes == stripes_avx2 ? "avx2" : "c";
#else
    const char *now = "c";
#endif
    if (name != NULL) {
        if (strcmp(name, "c") == 0)
            stripes = stripes_c;
#ifdef HAVE_AVX2_PATH
        else if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2"))
            stripes = stripes_avx2;
#endif
        else {
            PyErr_Format(PyExc_ValueError, "_path(): no stripe loop %s here", name);
            return NULL;
        }
    }
    return PyUnicode_FromString(now);
}

static PyMethodDef methods[] = {
    {"_path", path, METH_VARARGS, "_path(name=None): the stripe loop in use; switches to `name` if given"},
    {"digest", digest, METH_VARARGS,
     "digest(specs): a 64-bit digest of each (data_ptr, itemsize, sizes, strides) tensor's element bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvguard._native.digest", NULL, -1, methods};

PyMODINIT_FUNC
PyInit_digest(void)
{
    init_keys();
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        stripes = stripes_avx2;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New(&api, "kvguard._native.digest._api", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_api", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
