/* zeroplug's fused CPU-Adam step for block-quantised 8-bit moments (native.py builds
 * and loads it; the format is zeroplug.quantized_states'), and the same loop for bf16 and fp32
 * moments (zp_adam_bf16, zp_adam_f32).
 *
 * One pass over the state, block by block (256 elements, OpenMP over blocks): decode the
 * block's m and v codes into L1-resident fp32 buffers, apply the Adam(W) update in fp32 with
 * the math and operation order of kernels._adam_math (compiled with
 * -ffp-contract=off, so every operation rounds as torch's fp32 ops do), take the block's new
 * absmax of m and v, encode them and write p, the codes, the absmax and the optional
 * low-precision copy of p. Each input byte is read once and each output byte written once.
 *
 * Encoding equals torch.bucketize over the table's 255 midpoints (quantize_): the code is the
 * number of midpoints below x = value * (1 / absmax). The caller passes, per table, a bucket
 * table keyed by the top 16 bits of x (sign, exponent, 7 mantissa bits), magnitudes clamped
 * to [lo_key, lo_key + nkeys): the midpoints below the bucket and the one midpoint inside it,
 * if any (the caller checks that no bucket holds two). So code = base + (mid < x), exactly,
 * with one table load per element.
 *
 * The table lookups (decode and encode) are AVX-512 gathers where the compiler targets
 * AVX-512, the decode and the encode then each one loop of 16 lanes in GCC's generic vectors;
 * else scalar loads. Every other loop is plain C that the compiler vectorises.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define BLOCK 256

#if defined(__FLT16_MAX__)
#define ZP_HAS_F16 1
typedef _Float16 f16_t;
#else
#define ZP_HAS_F16 0
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_NONE = 3 };

int zp_abi_version(void) { return 5; }
int zp_has_f16(void) { return ZP_HAS_F16; }

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* torch's float -> bfloat16: round to nearest even, NaN -> 0x7fc0 */
static inline uint16_t f2bf(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (f != f) ? (uint16_t)0x7fc0 : (uint16_t)r;
}

/* Table lookups: gathers where the compiler targets AVX-512, else scalar loads
 * (-DZP_GATHER=0 / 1 chooses; with gathers on AVX2, each 16-wide gather is two 8-wide ones,
 * which the tests use to run the gather code on machines without AVX-512). Note: an AVX2
 * gather is slower than unrolled scalar loads on some CPUs (AMD Zen 3), yet compilers tuned
 * for them emit it; the empty asm keeps the scalar loops scalar. */
#ifndef ZP_GATHER
#if defined(__AVX512F__)
#define ZP_GATHER 1
#else
#define ZP_GATHER 0
#endif
#endif
#if ZP_GATHER && !defined(__AVX512F__) && !defined(__AVX2__)
#error "ZP_GATHER needs AVX2 or AVX-512"
#endif
#define ZP_SCALAR(v) __asm__("" : "+r"(v))

#if ZP_GATHER
/* 16 lanes in GCC's generic vectors: one zmm on AVX-512, two ymm on AVX2 */
typedef int32_t zi __attribute__((vector_size(64)));
typedef uint32_t zu __attribute__((vector_size(64)));
typedef float zf __attribute__((vector_size(64)));
typedef int8_t zb __attribute__((vector_size(16)));
typedef uint8_t zub __attribute__((vector_size(16)));

static inline zi gather_i16(const int32_t *t, zi idx) {
#if defined(__AVX512F__)
    return (zi)_mm512_i32gather_epi32((__m512i)idx, t, 4);
#else
    __m256i h[2], r[2];
    memcpy(h, &idx, sizeof h);
    r[0] = _mm256_i32gather_epi32((const int *)t, h[0], 4);
    r[1] = _mm256_i32gather_epi32((const int *)t, h[1], 4);
    zi out;
    memcpy(&out, r, sizeof out);
    return out;
#endif
}

static inline zf gather_f16(const float *t, zi idx) {
#if defined(__AVX512F__)
    return (zf)_mm512_i32gather_ps((__m512i)idx, t, 4);
#else
    __m256i h[2];
    __m256 r[2];
    memcpy(h, &idx, sizeof h);
    r[0] = _mm256_i32gather_ps(t, h[0], 4);
    r[1] = _mm256_i32gather_ps(t, h[1], 4);
    zf out;
    memcpy(&out, r, sizeof out);
    return out;
#endif
}
#else
static inline void lookup_i(const uint32_t *restrict t, const int32_t *restrict idx, uint32_t *restrict out) {
#pragma GCC unroll 8
    for (int i = 0; i < BLOCK; i++) {
        uint32_t v = t[idx[i]];
        ZP_SCALAR(v);
        out[i] = v;
    }
}
#endif

#if ZP_HAS_F16
static inline void f16_to_f32(const uint16_t *restrict in, float *restrict out, int n) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
#endif
    for (; i < n; i++) out[i] = (float)((const f16_t *)in)[i];
}

/* round to nearest even, as torch's .to(float16) */
static inline void f32_to_f16(const float *restrict in, uint16_t *restrict out, int n) {
    int i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) ((f16_t *)out)[i] = (f16_t)in[i];
}
#endif

typedef struct {
    const float *table;         /* 256 decode values */
    const uint32_t *enc;        /* encode buckets: 2 * nkeys (positive, then negative x) */
    int32_t lo_key, nkeys;
} qtab_t;

/* x[0:len] (the new values; x[len:BLOCK] are defined) -> codes[0:len] (table index - off),
 * given the block's absmax ``am``. A bucket entry is base << 16 | the low 16 bits of its
 * midpoint M: M shares the bucket's top 16 bits with x, so x > M compares the low halves,
 * reversed for x < 0 (a bucket without a midpoint holds 0xffff for x >= 0 and 0 for x < 0:
 * never below x). */
static inline void encode_block(const float *restrict x, int len, float am, const qtab_t *q,
                                uint8_t *restrict codes, int off) {
    const float inv = am > 0.0f ? 1.0f / am : 0.0f;
    const int32_t lo = q->lo_key, hi = q->lo_key + q->nkeys - 1, nk = q->nkeys;
#if ZP_GATHER
    /* one pass of 16 lanes: scale, bucket, gather, compare, narrow */
    const zi vlo = (zi){0} + lo, vhi = (zi){0} + hi;
    for (int i = 0; i < BLOCK; i += 16) {
        zf xv;
        memcpy(&xv, x + i, sizeof xv);
        zu u = (zu)(xv * inv);
        zi mag = (zi)((u >> 16) & 0x7fffu);
        zi below = mag < vlo, above = mag > vhi;
        mag = (mag & ~below) | (vlo & below);
        mag = (mag & ~above) | (vhi & above);
        zi neg = (zi)u >> 31;                                   /* 0 or -1 */
        zi e = gather_i16((const int32_t *)q->enc, (neg & nk) + (mag - vlo));
        zi d = (zi)(u & 0xffffu) - (e & 0xffff);
        zi dd = (d ^ neg) - neg;                                /* d, or -d for x < 0 */
        zi code = ((zi)((zu)e >> 16)) - (dd > 0) - off;         /* (dd > 0) is -1 where true */
        uint8_t out[16];
        if (off) {
            zb c8 = __builtin_convertvector(code, zb);
            memcpy(out, &c8, 16);
        } else {
            zub c8 = __builtin_convertvector(code, zub);
            memcpy(out, &c8, 16);
        }
        if (i + 16 <= len) {
            memcpy(codes + i, out, 16);
        } else {
            for (int k = 0; i + k < len; k++) codes[i + k] = out[k];
            break;
        }
    }
#else
    int32_t key[BLOCK] __attribute__((aligned(64)));
    uint32_t ub[BLOCK] __attribute__((aligned(64))), e[BLOCK] __attribute__((aligned(64)));
    for (int i = 0; i < BLOCK; i++) {
        uint32_t u = f2u(x[i] * inv);
        ub[i] = u;
        int32_t mag = (int32_t)((u >> 16) & 0x7fffu);
        mag = mag < lo ? lo : mag;
        mag = mag > hi ? hi : mag;
        key[i] = ((int32_t)0 - (int32_t)(u >> 31)) & nk;
        key[i] += mag - lo;
    }
    lookup_i(q->enc, key, e);
    for (int i = 0; i < len; i++) {
        int32_t d = (int32_t)(ub[i] & 0xffffu) - (int32_t)(e[i] & 0xffffu);
        int32_t neg = (int32_t)0 - (int32_t)(ub[i] >> 31);      /* 0 or -1 */
        int32_t dd = (d ^ neg) - neg;                           /* d, or -d for x < 0 */
        codes[i] = (uint8_t)((e[i] >> 16) + (uint32_t)(dd > 0) - (uint32_t)off);
    }
#endif
}

/* out[0:len] = the table values of codes[0:len] (table index = code + off), unscaled */
static inline void decode_block(const uint8_t *restrict codes, int len, int off, const float *table,
                                float *restrict out) {
#if ZP_GATHER
    uint8_t part[BLOCK];
    if (len < BLOCK) {          /* the last block: no read past the codes */
        memset(part, off ? 0x80 : 0, sizeof part);
        memcpy(part, codes, (size_t)len);
        codes = part;
    }
    for (int i = 0; i < BLOCK; i += 16) {
        zi idx;
        if (off) {
            zb c;
            memcpy(&c, codes + i, 16);
            idx = __builtin_convertvector(c, zi) + off;
        } else {
            zub c;
            memcpy(&c, codes + i, 16);
            idx = __builtin_convertvector(c, zi);
        }
        zf v = gather_f16(table, idx);
        memcpy(out + i, &v, sizeof v);
    }
#else
    const float *t = table + off;       /* indexed by the code itself */
#pragma GCC unroll 8
    for (int i = 0; i < len; i++) {
        float v = off ? t[(int8_t)codes[i]] : t[codes[i]];
        ZP_SCALAR(v);
        out[i] = v;
    }
#endif
}

enum { ST_Q8 = 0, ST_BF16 = 1, ST_F32 = 2 };

/* One block: STATE / GDT / LPDT / ADAMW are constants in each instantiation (inlined below).
 * ST_Q8: mc / vc are the int8 / uint8 codes, ma / va the absmax; ST_BF16: mc / vc are the bf16
 * moments (ma / va unused), widened on load and rounded to nearest even on the store; ST_F32:
 * mc / vc are the fp32 moments, loaded and stored as they are. */
static inline __attribute__((always_inline)) void step_block(
    int64_t b, int len, float *restrict p, const void *restrict gv, void *restrict mcv, float *restrict ma,
    void *restrict vcv, float *restrict va, void *restrict lpv, const float *restrict sc,
    const qtab_t *qs, const qtab_t *qu, const int STATE, const int GDT, const int LPDT, const int ADAMW) {
    float m[BLOCK] __attribute__((aligned(64)));
    float v[BLOCK] __attribute__((aligned(64)));
    float gb[BLOCK] __attribute__((aligned(64)));
    const int64_t s = b * BLOCK;
    uint8_t *restrict mc = (uint8_t *)mcv, *restrict vc = (uint8_t *)vcv;
    uint16_t *restrict mh = (uint16_t *)mcv + s, *restrict vh = (uint16_t *)vcv + s;
    float *restrict mf = (float *)mcv + s, *restrict vf = (float *)vcv + s;
    float am_m = 1.0f, am_v = 1.0f;
    if (STATE == ST_Q8) {
        if (len < BLOCK) {      /* the last block: what encode reads past len is defined */
            memset(m, 0, sizeof m);
            memset(v, 0, sizeof v);
        }
        decode_block(mc + s, len, 128, qs->table, m);
        decode_block(vc + s, len, 0, qu->table, v);
        am_m = ma[b];
        am_v = va[b];
    }
    const float s0 = sc[0], s1 = sc[1], s2 = sc[2], s3 = sc[3], s4 = sc[4], s5 = sc[5], s6 = sc[6], s7 = sc[7],
                s8 = sc[8];
    float *restrict pp = p + s;
    const float *restrict gp = gb;
    if (GDT == DT_F32) {
        gp = (const float *)gv + s;
    } else if (GDT == DT_BF16) {
        const uint16_t *restrict gh = (const uint16_t *)gv + s;
        for (int i = 0; i < len; i++) gb[i] = u2f((uint32_t)gh[i] << 16);
    } else {
#if ZP_HAS_F16
        f16_to_f32((const uint16_t *)gv + s, gb, len);
#endif
    }
    /* the new absmax as the largest bit pattern of |x| (non-negative floats order as their bits) */
    uint32_t top_m = 0, top_v = 0;
    for (int i = 0; i < len; i++) {
        float gf = gp[i] * s0;
        float pi = pp[i];
        float pd;
        if (ADAMW) {
            pd = pi * s1;
        } else {
            pd = pi;
            gf = gf + pi * s1;
        }
        float mo = STATE == ST_Q8 ? m[i] * am_m : STATE == ST_BF16 ? u2f((uint32_t)mh[i] << 16) : mf[i];
        float vo = STATE == ST_Q8 ? v[i] * am_v : STATE == ST_BF16 ? u2f((uint32_t)vh[i] << 16) : vf[i];
        float mn = mo * s2 + s3 * gf;
        float vn = vo * s4 + (s5 * gf) * gf;
        float den = sqrtf(vn) * s6 + s7;
        float pn = pd + (s8 * mn) / den;
        pp[i] = pn;
        if (STATE == ST_Q8) {
            m[i] = mn;
            v[i] = vn;
        } else if (STATE == ST_BF16) {
            mh[i] = f2bf(mn);
            vh[i] = f2bf(vn);
        } else {
            mf[i] = mn;
            vf[i] = vn;
        }
        uint32_t bm = f2u(mn) & 0x7fffffffu, bv = f2u(vn) & 0x7fffffffu;
        top_m = bm > top_m ? bm : top_m;
        top_v = bv > top_v ? bv : top_v;
        if (LPDT == DT_F32) ((float *)lpv)[s + i] = pn;
        else if (LPDT == DT_BF16) ((uint16_t *)lpv)[s + i] = f2bf(pn);
    }
#if ZP_HAS_F16
    if (LPDT == DT_F16) f32_to_f16(pp, (uint16_t *)lpv + s, len);
#endif
    if (STATE == ST_Q8) {
        ma[b] = u2f(top_m);
        va[b] = u2f(top_v);
        encode_block(m, len, u2f(top_m), qs, mc + s, 128);
        encode_block(v, len, u2f(top_v), qu, vc + s, 0);
    }
}

#define ZP_LOOP(STATE, GDT, LPDT, ADAMW)                                                                    \
    do {                                                                                                    \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                  \
        for (int64_t b = 0; b < nb; b++) {                                                                  \
            int len = (b == nb - 1) ? (int)(n - b * BLOCK) : BLOCK;                                         \
            step_block(b, len, p, g, mc, ma, vc, va, lp, sc, qs, qu, STATE, GDT, LPDT, ADAMW);              \
        }                                                                                                   \
    } while (0)

#define ZP_LP(STATE, GDT, ADAMW)                                                                            \
    switch (lpdt) {                                                                                         \
    case DT_F32: ZP_LOOP(STATE, GDT, DT_F32, ADAMW); break;                                                 \
    case DT_BF16: ZP_LOOP(STATE, GDT, DT_BF16, ADAMW); break;                                               \
    case DT_F16: ZP_LOOP(STATE, GDT, DT_F16, ADAMW); break;                                                 \
    default: ZP_LOOP(STATE, GDT, DT_NONE, ADAMW); break;                                                    \
    }

#define ZP_G(STATE, ADAMW)                                                                                  \
    switch (gdt) {                                                                                          \
    case DT_F32: ZP_LP(STATE, DT_F32, ADAMW); break;                                                        \
    case DT_BF16: ZP_LP(STATE, DT_BF16, ADAMW); break;                                                      \
    default: ZP_LP(STATE, DT_F16, ADAMW); break;                                                            \
    }

static int check_dtypes(int gdt, int lpdt) {
    if (gdt < DT_F32 || gdt > DT_F16 || lpdt < DT_F32 || lpdt > DT_NONE) return -1;
    if (!ZP_HAS_F16 && (gdt == DT_F16 || lpdt == DT_F16)) return -1;
    return 0;
}

/* The body every entry point shares: check the dtypes, then step the blocks of STATE (the
 * names ZP_G's loops read must be in scope: p, g, mc, ma, vc, va, lp, sc, qs, qu). */
#define ZP_STEP(STATE)                                                                                      \
    do {                                                                                                    \
        if (check_dtypes(gdt, lpdt)) return -1;                                                             \
        if (n <= 0) return 0;                                                                               \
        if (threads < 1) threads = 1;                                                                       \
        const int64_t nb = (n + BLOCK - 1) / BLOCK;                                                         \
        if (adamw) {                                                                                        \
            ZP_G(STATE, 1);                                                                                 \
        } else {                                                                                            \
            ZP_G(STATE, 0);                                                                                 \
        }                                                                                                   \
        return 0;                                                                                           \
    } while (0)

/* The step of n elements (the state's first element starts block 0). p: fp32; g: gdt;
 * mc: int8 codes (signed table), ma: fp32 per block; vc: uint8 codes (unsigned table), va;
 * lp: lpdt or DT_NONE (NULL); sc: the 9 scalars of kernels.scalars(); tables: for
 * the signed then the unsigned code, decode values (256 fp32), encode base (int32) and mid
 * (fp32) of 2 * nkeys buckets each. Returns 0, or -1 for an unsupported dtype. */
int zp_adam_q8(int64_t n, float *p, const void *g, int gdt, int8_t *mc8, float *ma, uint8_t *vc, float *va,
               void *lp, int lpdt, const float *sc, int adamw, int threads, const float *table_s,
               const uint32_t *enc_s, const float *table_u, const uint32_t *enc_u, int32_t lo_key, int32_t nkeys) {
    void *mc = (void *)mc8;
    const qtab_t tab_s = {table_s, enc_s, lo_key, nkeys}, tab_u = {table_u, enc_u, lo_key, nkeys};
    const qtab_t *qs = &tab_s, *qu = &tab_u;
    ZP_STEP(ST_Q8);
}

/* The same step with bf16 moments m and v (n elements each; rounded to nearest even on the
 * store, as torch's .to(bfloat16)). Returns 0, or -1 for an unsupported dtype. */
int zp_adam_bf16(int64_t n, float *p, const void *g, int gdt, uint16_t *mc, uint16_t *vc, void *lp, int lpdt,
                 const float *sc, int adamw, int threads) {
    float *ma = NULL, *va = NULL;
    const qtab_t *qs = NULL, *qu = NULL;
    ZP_STEP(ST_BF16);
}

/* The same step with fp32 moments m and v (n elements each, updated in place). Returns 0, or -1
 * for an unsupported dtype. */
int zp_adam_f32(int64_t n, float *p, const void *g, int gdt, float *mc, float *vc, void *lp, int lpdt,
                const float *sc, int adamw, int threads) {
    float *ma = NULL, *va = NULL;
    const qtab_t *qs = NULL, *qu = NULL;
    ZP_STEP(ST_F32);
}

/* The codes and absmax quantize_ gives n fp32 values (x is not changed): the encoder
 * alone, for tests. signed_: int8 codes of the signed table, else uint8 of the unsigned one. */
int zp_q8_encode(int64_t n, float *x, uint8_t *codes, float *absmax, int signed_, const float *table,
                 const uint32_t *enc, int32_t lo_key, int32_t nkeys) {
    const qtab_t q = {table, enc, lo_key, nkeys};
    const int64_t nb = (n + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < nb; b++) {
        int len = (b == nb - 1) ? (int)(n - b * BLOCK) : BLOCK;
        float buf[BLOCK] = {0};
        uint32_t top = 0;
        for (int i = 0; i < len; i++) {
            float xi = x[b * BLOCK + i];
            uint32_t bits = signed_ ? f2u(xi) & 0x7fffffffu : f2u(xi);
            buf[i] = xi;
            top = bits > top ? bits : top;
        }
        absmax[b] = u2f(top);
        encode_block(buf, len, u2f(top), &q, codes + b * BLOCK, signed_ ? 128 : 0);
    }
    return 0;
}
