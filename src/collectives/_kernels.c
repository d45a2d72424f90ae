/* Reproducible sums of float32 terms, compiled: the same integers, so the same bits, as the NumPy passes
 * of collectives/_reproducible.py (codes, encode, decode), fused per element. Loaded with ctypes by
 * _reproducible (no Python API here); where it is missing the NumPy passes run instead.
 *
 * A term x of element i, whose code (the largest exponent code over every term of i) is c, becomes the
 * integer trunc(x * 2**(162 - c)) (162 = S + bias - 1, S = 36 fraction bits): exact in double (x has 24
 * bits, the scale is a power of two, the product is below 2**36 and above 2**-242 in magnitude). Sums of
 * at most 2**16 such integers are below 2**52: double adds them exactly, in any order. Decoding scales the
 * sum back by 2**(c - 162) (exact) and rounds once to float. Code 255 (inf or NaN somewhere) and code 0
 * (every term -0.0) are the special elements, as in _reproducible.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SHIFT 162
#define SPECIAL 255u
#define NAN_AT 17179869184.0 /* 2**34 */
#define PINF_AT 131072.0     /* 2**17 */
#define BLOCK 2048           /* elements per piece of the fused sum (its codes and words stay in cache) */

/* Each pass in three versions, chosen when the library is loaded (GCC's function multi-versioning): for
 * AVX-512 and AVX2 (the vector loops that make these passes faster than NumPy's) and for any x86-64 CPU.
 * Every version computes the same integers: IEEE double arithmetic, no fast-math. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define VERSIONS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VERSIONS
#endif

static inline uint32_t code_of(uint32_t b) {
    uint32_t e = (b >> 23) & 0xFFu;
    uint32_t low = b == 0u ? 1u : (b == 0x80000000u ? 0u : 2u); /* +0.0, -0.0, subnormal or smallest */
    return e < 2u ? low : e;
}

static inline double pow2(int k) { /* 2**k for k in [-1022, 1023] */
    union { uint64_t bits; double d; } v = {(uint64_t)(k + 1023) << 52};
    return v.d;
}

/* out[i] = the largest code of terms[u][i] over the k terms (k >= 1). */
VERSIONS void coll_codes_f32(const uint32_t *const *terms, int64_t k, int64_t n, uint8_t *restrict out) {
    const uint32_t *restrict t = terms[0];
    for (int64_t i = 0; i < n; i++) out[i] = (uint8_t)code_of(t[i]);
    for (int64_t u = 1; u < k; u++) {
        t = terms[u];
        for (int64_t i = 0; i < n; i++) {
            uint8_t c = (uint8_t)code_of(t[i]);
            out[i] = c > out[i] ? c : out[i];
        }
    }
}

static inline void add_words(const float *restrict t, const double *restrict scale, int64_t n,
                             double *restrict words) {
    for (int64_t i = 0; i < n; i++) words[i] += trunc((double)t[i] * scale[i]);
}

static void specials_in(const float *const *terms, int64_t k, int64_t n, const uint8_t *codes, double *words) {
    for (int64_t i = 0; i < n; i++) {
        if (codes[i] != SPECIAL) continue;
        double count = 0.0;
        for (int64_t u = 0; u < k; u++) {
            float x = terms[u][i];
            count += isnan(x) ? NAN_AT : (x == INFINITY ? PINF_AT : (x == -INFINITY ? 1.0 : 0.0));
        }
        words[i] = count;
    }
}

/* words[i] = the sum over the k terms of trunc(terms[u][i] * 2**(162 - codes[i])); where codes[i] is 255,
 * the counts of NaNs (* 2**34), +infs (* 2**17) and -infs instead. k may be 0 (zeros). Returns nothing. */
VERSIONS void coll_encode_f32(const float *const *terms, int64_t k, int64_t n, const uint8_t *restrict codes,
                              double *restrict words) {
    int special = 0;
    double scale[BLOCK];
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t m = n - lo < BLOCK ? n - lo : BLOCK;
        for (int64_t i = 0; i < m; i++) {
            scale[i] = pow2(SHIFT - (int)codes[lo + i]);
            words[lo + i] = 0.0;
        }
        for (int64_t u = 0; u < k; u++) add_words(terms[u] + lo, scale, m, words + lo);
    }
    for (int64_t i = 0; i < n; i++) special |= codes[i] == SPECIAL;
    if (special) specials_in(terms, k, n, codes, words);
}

static inline double special_out(double first) {
    int64_t w = (int64_t)first;
    int nan = (w >> 34) != 0, pinf = ((w >> 17) & 0x1FFFF) != 0, ninf = (w & 0x1FFFF) != 0;
    return (nan || (pinf && ninf)) ? (double)NAN : (pinf ? INFINITY : -INFINITY);
}

/* out[i] = the float nearest words[i] * 2**(codes[i] - 162) (mean: that divided by terms in double first);
 * code 0: -0.0; code 255: NaN or the inf that the counts say. */
VERSIONS void coll_decode_f32(const double *restrict words, const uint8_t *restrict codes, int64_t n, int mean,
                              double terms, float *restrict out) {
    int special = 0;
    for (int64_t i = 0; i < n; i++) {
        uint8_t c = codes[i];
        double v = words[i] * pow2((int)c - SHIFT) + 0.0; /* a zero sum is +0.0 whatever its sign */
        v = c == 0 ? -0.0 : v;
        if (mean) v = v / terms;
        out[i] = (float)v;
        special |= c == SPECIAL;
    }
    if (!special) return;
    for (int64_t i = 0; i < n; i++) {
        if (codes[i] != SPECIAL) continue;
        double v = special_out(words[i]);
        if (mean) v = v / terms;
        out[i] = (float)v;
    }
}

/* The fused sum of K terms (a constant where it is inlined: its loop over the terms unrolled, the loop over
 * the elements vectorized): codes, words and the conversion back in one pass over the elements. */
static inline void sum_k(const float *const *terms, const int K, int64_t n, int mean, float *restrict out) {
    const double terms_d = (double)K;
    int special = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t c = 0;
        for (int u = 0; u < K; u++) {
            uint32_t b;
            memcpy(&b, terms[u] + i, sizeof b);
            uint32_t cu = code_of(b);
            c = cu > c ? cu : c;
        }
        double scale = pow2(SHIFT - (int)c), w = 0.0;
        for (int u = 0; u < K; u++) w += trunc((double)terms[u][i] * scale);
        double v = w * pow2((int)c - SHIFT) + 0.0;
        v = c == 0 ? -0.0 : v;
        if (mean) v = v / terms_d;
        out[i] = (float)v;
        special |= c == SPECIAL;
    }
    if (!special) return;
    for (int64_t i = 0; i < n; i++) { /* inf or NaN among some element's terms: as decode gives them */
        uint32_t c = 0;
        double count = 0.0;
        for (int u = 0; u < K; u++) {
            float x = terms[u][i];
            uint32_t b;
            memcpy(&b, &x, sizeof b);
            uint32_t cu = code_of(b);
            c = cu > c ? cu : c;
            count += isnan(x) ? NAN_AT : (x == INFINITY ? PINF_AT : (x == -INFINITY ? 1.0 : 0.0));
        }
        if (c != SPECIAL) continue;
        double v = special_out(count);
        if (mean) v = v / terms_d;
        out[i] = (float)v;
    }
}

/* out = the reproducible sum (mean: / k) of the k terms, element by element: 2 to 4 terms in one fused
 * pass, 1 or 5 to MAX_TERMS piece by piece (codes, words and the conversion back). Returns 0, or
 * COLL_BAD_TERMS (nothing written) for k outside 1..MAX_TERMS: the caller (_reproducible.sum_terms) then
 * raises, never leaves out unwritten without saying so. */
#define MAX_TERMS 64
#define COLL_BAD_TERMS 1
VERSIONS int coll_sum_f32(const float *const *terms, int64_t k, int64_t n, int mean, float *out) {
    uint8_t codes[BLOCK];
    double words[BLOCK];
    const float *at[MAX_TERMS];
    switch (k) {
        case 2: sum_k(terms, 2, n, mean, out); return 0;
        case 3: sum_k(terms, 3, n, mean, out); return 0;
        case 4: sum_k(terms, 4, n, mean, out); return 0;
        default: break;
    }
    if (k < 1 || k > MAX_TERMS) return COLL_BAD_TERMS;
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t m = n - lo < BLOCK ? n - lo : BLOCK;
        for (int64_t u = 0; u < k; u++) at[u] = terms[u] + lo;
        coll_codes_f32((const uint32_t *const *)at, k, m, codes);
        coll_encode_f32(at, k, m, codes, words);
        coll_decode_f32(words, codes, m, mean, (double)k, out + lo);
    }
    return 0;
}

/* ---- the node-shared window's slice of an ordinary float sum or mean (collectives/_backends/shm.py) ----
 * res[i] = the k terms' sum in rank order, (((t0 + t1) + t2) + ...), each addition rounded to the type as
 * NumPy's add rounds it, and out[i] = res[i] (sum) or res[i] / divisor (mean, divisor > 0): the bits of
 * np.add(t0, t1, out=res), np.add(res, t2, out=res) ... then np.divide(res, divisor, out=out), in one
 * pass over the elements instead of two. A term may be out itself (the rank's own data, read before its
 * element is written); res is the window's region (no term). Block by block, so the second loop reads
 * res from the first level of cache. k >= 2. */
#define ADD_BLOCK 2048
#define ADD_PASS(NAME, T)                                                                                    \
    VERSIONS void NAME(const T *const *terms, int64_t k, int64_t n, double divisor, T *restrict res,        \
                       T *out) {                                                                           \
        const T d = (T)divisor;                                                                            \
        for (int64_t lo = 0; lo < n; lo += ADD_BLOCK) {                                                    \
            int64_t m = n - lo < ADD_BLOCK ? n - lo : ADD_BLOCK;                                           \
            T *restrict r = res + lo;                                                                      \
            const T *a = terms[0] + lo, *b = terms[1] + lo;                                                \
            for (int64_t i = 0; i < m; i++) r[i] = a[i] + b[i];                                            \
            for (int64_t u = 2; u < k; u++) {                                                              \
                const T *t = terms[u] + lo;                                                                \
                for (int64_t i = 0; i < m; i++) r[i] = r[i] + t[i];                                        \
            }                                                                                              \
            T *o = out + lo;                                                                               \
            if (divisor > 0.0)                                                                             \
                for (int64_t i = 0; i < m; i++) o[i] = r[i] / d;                                           \
            else                                                                                           \
                memcpy(o, r, (size_t)m * sizeof(T));                                                       \
        }                                                                                                  \
    }
ADD_PASS(coll_add_f32, float)
ADD_PASS(coll_add_f64, double)
