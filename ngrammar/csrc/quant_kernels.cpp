// Block-quantized projections on the CPU: a GGUF's Q4_1 weight blocks against activations quantized
// per block of 32 to int8 (llama.cpp's Q8_1: a step d and the block's sum s = d * sum(q)), and the LM
// head's Q8_0 blocks against activations quantized per block of 32 to int16 (the logits take int8
// activations' rounding badly: +0.7% perplexity on the embedded model, against ~0 with int16).
//
// Each output is sum over K's blocks, in block order, of
//     Q4_1:  (d_w * d_a) * isum + m_w * s_a        Q8_0:  (d_w * d_a) * isum
// where isum = sum of the 32 integer products, exact in int32 (then one rounding to float, the same
// on every path). The integer sums may be formed in any order (they are exact); the float operations of one output run one after another in block order,
// each a single rounding (-ffp-contract=off, no fast-math). A SIMD lane is one output column, never a
// part of one, so the AVX-512 VNNI, AVX2 and scalar paths give bitwise the same numbers, whatever the
// number of rows in the call or the threads: a row's outputs never depend on the rows beside it.
//
// Weights are repacked at load into groups of 16 output columns (kCols), one record per group and
// block of 32 along K:
//     Q4_1: 4 x 64 bytes of codes, then d[16] and m[16] as fp16 (320 bytes). Byte 4 c + i of chunk t
//           holds column c's code 4 t + i in its low nibble and code 16 + 4 t + i in its high one.
//     Q8_0: 16 x 32 bytes of int8 codes, then d[16] as fp16 (544 bytes). Byte 2 c + i of chunk t
//           holds column c's code 2 t + i.
// so that one 32-bit lane of a chunk is consecutive codes of one column: Q4_1's 4 codes meet 4
// broadcast activation bytes in VNNI's vpdpbusd (AVX2: maddubs + madd); Q8_0's 2 codes, widened to
// int16, meet 2 broadcast int16 activations in vpdpwssd (AVX2: madd).
// Every path is compiled into the one library (function-level target attributes); the best the CPU
// supports runs (its features, never a timing), and tests run each supported path against the others.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define NGM_X86 1
#define NGM_AVX2 __attribute__((target("avx2,f16c")))
#define NGM_AVX512 __attribute__((target("avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#else
#define NGM_X86 0
#endif

namespace {

constexpr int kBlock = 32;   // weights per block along K
constexpr int kCols = 16;    // output columns per group (one zmm of float32 lanes)
constexpr int kQ4Record = 4 * 64 + 2 * kCols * 2;
constexpr int kQ8Record = 8 * 64 + kCols * 2;
constexpr int kMaxTile = 4;  // rows computed together against one load of a block's codes
constexpr int64_t kRowChunk = 64;  // rows whose activations stay in cache while a thread sweeps its groups

enum Path : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };
enum Format : int { kQ4_1 = 0, kQ8_0 = 1 };

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int32_t load_i32(const int16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Activations quantized per row and block: codes [M, K] (int8 for Q4_1, int16 for Q8_0), d and
// s = d * sum(codes) [M, K / 32] float. Each block on its own: step amax / qmax (127 or 32767),
// codes rounded to nearest even.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<int16_t> q16;
  std::vector<float> d, s;
};

template <typename Q>
void quantize_blocks(const float* x, int64_t blocks, Q* q, float* ds, float* ss) {
  constexpr float qmax = sizeof(Q) == 1 ? 127.f : 32767.f;
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t rb = begin; rb < end; ++rb) {
      const float* xb = x + rb * kBlock;  // row r's block b is element rb * 32 of the row-major x
      float amax = 0.f;
      for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
      const float d = amax / qmax;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int32_t total = 0;
      Q* qb = q + rb * kBlock;
      for (int i = 0; i < kBlock; ++i) {
        float v = std::nearbyint(xb[i] * id);
        v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
        qb[i] = static_cast<Q>(v);
        total += qb[i];
      }
      ds[rb] = d;
      ss[rb] = d * static_cast<float>(total);
    }
  });
}

void quantize_rows(const float* x, int64_t m, int64_t k, bool wide, QuantizedRows& out) {
  const int64_t nb = k / kBlock;
  out.d.resize(m * nb);
  out.s.resize(m * nb);
  if (wide) {
    out.q16.resize(m * k);
    quantize_blocks(x, m * nb, out.q16.data(), out.d.data(), out.s.data());
  } else {
    out.q.resize(m * k);
    quantize_blocks(x, m * nb, out.q.data(), out.d.data(), out.s.data());
  }
}

// The per-block float step of one output, shared by every path's lanes:
// acc + ((d_w * d_a) * isum + m_w * s_a) for Q4_1, acc + (d_w * d_a) * isum for Q8_0.
template <int F>
inline float block_step(float acc, float dw, float mw, float da, float sa, int32_t isum) {
  const float t = (dw * da) * static_cast<float>(isum);
  if constexpr (F == kQ4_1) return acc + (t + mw * sa);
  return acc + t;
}

struct Args {
  const uint8_t* w;  // [G, B, record]
  const QuantizedRows* a;
  int64_t k, nb, n_out;  // K, blocks, output row stride (G * 16)
  float* y;
};

// ---- scalar ----

template <int F>
void group_scalar(const Args& p, int64_t g, int64_t r0, int64_t rows) {
  constexpr int rec = F == kQ4_1 ? kQ4Record : kQ8Record;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    float acc[kCols] = {0.f};
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* blk = p.w + (g * p.nb + b) * rec;
      const float da = p.a->d[r * p.nb + b], sa = p.a->s[r * p.nb + b];
      for (int c = 0; c < kCols; ++c) {
        int32_t isum = 0;
        float mw = 0.f;
        if constexpr (F == kQ4_1) {
          const int8_t* qb = p.a->q.data() + r * p.k + b * kBlock;
          for (int t = 0; t < 4; ++t)
            for (int i = 0; i < 4; ++i) {
              const int byte = blk[t * 64 + 4 * c + i];
              isum += (byte & 15) * qb[4 * t + i] + (byte >> 4) * qb[16 + 4 * t + i];
            }
          mw = half_to_float(blk + 256 + kCols * 2 + 2 * c);
        } else {
          const int16_t* qb = p.a->q16.data() + r * p.k + b * kBlock;
          for (int t = 0; t < 16; ++t)
            for (int i = 0; i < 2; ++i) isum += static_cast<int8_t>(blk[t * 32 + 2 * c + i]) * qb[2 * t + i];
        }
        const float dw = half_to_float(blk + (F == kQ4_1 ? 256 : 512) + 2 * c);
        acc[c] = block_step<F>(acc[c], dw, mw, da, sa, isum);
      }
    }
    for (int c = 0; c < kCols; ++c) p.y[r * p.n_out + g * kCols + c] = acc[c];
  }
}

#if NGM_X86

// ---- AVX2: maddubs (u8 x s8 -> pairs in int16) + madd with ones (-> int32 per 4 bytes) ----

// R rows against one group's 16 columns, as two halves of 8 lanes (h = 0, 1).
template <int F, int R>
NGM_AVX2 void tile_avx2(const Args& p, int64_t g, int64_t r0) {
  constexpr int rec = F == kQ4_1 ? kQ4Record : kQ8Record;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* blk = p.w + (g * p.nb + b) * rec;
      const __m256 dw = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == kQ4_1 ? 256 : 512) + 16 * h)));
      if constexpr (F == kQ4_1) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)));
        __m256i w[8];
        for (int t = 0; t < 4; ++t) {
          const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * t + 32 * h));
          w[t] = _mm256_and_si256(c, low);
          w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          const int8_t* qb = p.a->q.data() + row * p.k + b * kBlock;
          // 8 pair sums of at most 2 * 15 * 127 each: the int16 total cannot overflow.
          __m256i s16 = _mm256_setzero_si256();
          for (int t = 0; t < 8; ++t)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(load_i32(qb + 4 * t))));
          const __m256i isum = _mm256_madd_epi16(s16, ones);
          const __m256 t1 = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(p.a->d[row * p.nb + b])),
                                          _mm256_cvtepi32_ps(isum));
          const __m256 t2 = _mm256_mul_ps(mw, _mm256_set1_ps(p.a->s[row * p.nb + b]));
          acc[r] = _mm256_add_ps(acc[r], _mm256_add_ps(t1, t2));
        }
      } else {
        __m256i w[16];
        for (int t = 0; t < 16; ++t)
          w[t] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 * t + 16 * h)));
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          const int16_t* qb = p.a->q16.data() + row * p.k + b * kBlock;
          __m256i isum = _mm256_setzero_si256();
          for (int t = 0; t < 16; ++t)
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(w[t], _mm256_set1_epi32(load_i32(qb + 2 * t))));
          const __m256 t1 = _mm256_mul_ps(_mm256_mul_ps(dw, _mm256_set1_ps(p.a->d[row * p.nb + b])),
                                          _mm256_cvtepi32_ps(isum));
          acc[r] = _mm256_add_ps(acc[r], t1);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(p.y + (r0 + r) * p.n_out + g * kCols + 8 * h, acc[r]);
  }
}

// ---- AVX-512 VNNI: vpdpbusd (u8 x s8, 4 bytes per int32 lane) ----

template <int F, int R>
NGM_AVX512 void tile_avx512(const Args& p, int64_t g, int64_t r0) {
  constexpr int rec = F == kQ4_1 ? kQ4Record : kQ8Record;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* blk = p.w + (g * p.nb + b) * rec;
    const __m512 dw = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (F == kQ4_1 ? 256 : 512))));
    if constexpr (F == kQ4_1) {
      __m512i w[8];
      for (int t = 0; t < 4; ++t) {
        const __m512i c = _mm512_loadu_si512(blk + 64 * t);
        w[t] = _mm512_and_si512(c, low);
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
      }
      const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* qb = p.a->q.data() + row * p.k + b * kBlock;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t) {
          s0 = _mm512_dpbusd_epi32(s0, w[t], _mm512_set1_epi32(load_i32(qb + 4 * t)));
          s1 = _mm512_dpbusd_epi32(s1, w[t + 4], _mm512_set1_epi32(load_i32(qb + 16 + 4 * t)));
        }
        const __m512i isum = _mm512_add_epi32(s0, s1);
        const __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(p.a->d[row * p.nb + b])),
                                        _mm512_cvtepi32_ps(isum));
        const __m512 t2 = _mm512_mul_ps(mw, _mm512_set1_ps(p.a->s[row * p.nb + b]));
        acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(t1, t2));
      }
    } else {
      __m512i w[16];
      for (int t = 0; t < 16; ++t)
        w[t] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * t)));
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int16_t* qb = p.a->q16.data() + row * p.k + b * kBlock;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int t = 0; t < 16; t += 2) {
          s0 = _mm512_dpwssd_epi32(s0, w[t], _mm512_set1_epi32(load_i32(qb + 2 * t)));
          s1 = _mm512_dpwssd_epi32(s1, w[t + 1], _mm512_set1_epi32(load_i32(qb + 2 * t + 2)));
        }
        const __m512i isum = _mm512_add_epi32(s0, s1);
        acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(p.a->d[row * p.nb + b])),
                                                     _mm512_cvtepi32_ps(isum)));
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.y + (r0 + r) * p.n_out + g * kCols, acc[r]);
}

template <int F>
NGM_AVX2 void group_avx2(const Args& p, int64_t g, int64_t r0, int64_t rows) {
  int64_t r = r0;
  for (; r + kMaxTile <= r0 + rows; r += kMaxTile) tile_avx2<F, kMaxTile>(p, g, r);
  switch (r0 + rows - r) {
    case 3: tile_avx2<F, 3>(p, g, r); break;
    case 2: tile_avx2<F, 2>(p, g, r); break;
    case 1: tile_avx2<F, 1>(p, g, r); break;
    default: break;
  }
}

template <int F>
NGM_AVX512 void group_avx512(const Args& p, int64_t g, int64_t r0, int64_t rows) {
  int64_t r = r0;
  for (; r + kMaxTile <= r0 + rows; r += kMaxTile) tile_avx512<F, kMaxTile>(p, g, r);
  switch (r0 + rows - r) {
    case 3: tile_avx512<F, 3>(p, g, r); break;
    case 2: tile_avx512<F, 2>(p, g, r); break;
    case 1: tile_avx512<F, 1>(p, g, r); break;
    default: break;
  }
}

#endif  // NGM_X86

bool path_supported(int path) {
  if (path == kScalar) return true;
#if NGM_X86
  __builtin_cpu_init();
  if (path == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (path == kAvx512Vnni)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("f16c");
#endif
  return false;
}

int best_path() {
  static const int best = path_supported(kAvx512Vnni) ? kAvx512Vnni : (path_supported(kAvx2) ? kAvx2 : kScalar);
  return best;
}

template <int F>
void run_groups(const Args& p, int path, int64_t m, int64_t g0, int64_t g1) {
  for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
    const int64_t rows = r0 + kRowChunk < m ? kRowChunk : m - r0;
    for (int64_t g = g0; g < g1; ++g) {
#if NGM_X86
      if (path == kAvx512Vnni) {
        group_avx512<F>(p, g, r0, rows);
        continue;
      }
      if (path == kAvx2) {
        group_avx2<F>(p, g, r0, rows);
        continue;
      }
#endif
      group_scalar<F>(p, g, r0, rows);
    }
  }
}

}  // namespace

namespace {

void check_packed(const torch::Tensor& packed, int64_t format, int64_t k) {
  TORCH_CHECK(format == kQ4_1 || format == kQ8_0, "block_linear: format 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kByte && packed.is_contiguous(),
              "block_linear: packed [G, K / 32, record] uint8, contiguous");
  const int64_t record = format == kQ4_1 ? kQ4Record : kQ8Record;
  TORCH_CHECK(packed.size(2) == record, "block_linear: record size ", packed.size(2), " for format ", format);
  TORCH_CHECK(k == packed.size(1) * kBlock, "block_linear: K ", k, " against ", packed.size(1), " blocks of 32");
}

// h [M, K] float32 (contiguous) against the packed weights -> [M, G * 16] float32.
torch::Tensor run_block_linear(const float* h, int64_t m, int64_t k, const torch::Tensor& packed, int64_t format,
                               int64_t path) {
  const int64_t groups = packed.size(0), nb = packed.size(1);
  if (path < 0) path = best_path();
  TORCH_CHECK(path_supported(static_cast<int>(path)), "block_linear: path ", path, " not supported by this CPU");
  auto y = torch::empty({m, groups * kCols}, torch::dtype(torch::kFloat));
  if (m == 0 || groups == 0) return y;
  QuantizedRows a;
  quantize_rows(h, m, k, format == kQ8_0, a);
  const Args p{packed.data_ptr<uint8_t>(), &a, k, nb, groups * kCols, y.data_ptr<float>()};
  const int ip = static_cast<int>(path);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    if (format == kQ4_1)
      run_groups<kQ4_1>(p, ip, m, g0, g1);
    else
      run_groups<kQ8_0>(p, ip, m, g0, g1);
  });
  return y;
}

torch::Tensor float_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, what, ": [M, K] float32");
  return x.contiguous();
}

}  // namespace

// x [M, K] float32 against packed weights [G, K / 32, record] uint8 (format 0: Q4_1, 1: Q8_0) ->
// [M, G * 16] float32. path: -1 the best the CPU supports, else 0 scalar, 1 AVX2, 2 AVX-512 VNNI
// (the same numbers on each; the tests compare them). Parallel over column groups.
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t format, int64_t path) {
  const auto xc = float_rows(x, "block_linear");
  check_packed(packed, format, xc.size(1));
  return run_block_linear(xc.data_ptr<float>(), xc.size(0), xc.size(1), packed, format, path);
}

// The layer's norm in front of a projection, one call: s = x + residual (when given), then
// h = weight * (s * 1 / sqrt(mean(s^2) + eps)) (mean: 16 lanes over K, then the lanes in order) into
// block_linear. Returns (h's projection, s, or an empty tensor without a residual).
std::vector<torch::Tensor> rmsnorm_block_linear(const torch::Tensor& x, const torch::Tensor& residual,
                                                const torch::Tensor& weight, double eps,
                                                const torch::Tensor& packed, int64_t format) {
  const auto xc = float_rows(x, "rmsnorm_block_linear");
  const int64_t m = xc.size(0), k = xc.size(1);
  check_packed(packed, format, k);
  const auto wc = weight.contiguous();
  TORCH_CHECK(wc.scalar_type() == torch::kFloat && wc.numel() == k, "rmsnorm_block_linear: weight [K] float32");
  const bool add = residual.numel() > 0;
  torch::Tensor summed = add ? torch::empty_like(xc) : torch::empty({0}, xc.options());
  torch::Tensor rc = add ? float_rows(residual, "rmsnorm_block_linear residual") : residual;
  auto h = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* rp = add ? rc.data_ptr<float>() : nullptr;
  float* sp = add ? summed.data_ptr<float>() : nullptr;
  const float* wp = wc.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const float fe = static_cast<float>(eps);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* s = xp + r * k;
      if (add) {
        float* out = sp + r * k;
        for (int64_t i = 0; i < k; ++i) out[i] = s[i] + rp[r * k + i];
        s = out;
      }
      float lanes[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= k; i += 16)
        for (int j = 0; j < 16; ++j) lanes[j] += s[i + j] * s[i + j];
      for (int j = 0; i + j < k; ++j) lanes[j] += s[i + j] * s[i + j];
      float total = 0.f;
      for (int j = 0; j < 16; ++j) total += lanes[j];
      const float inv = 1.f / std::sqrt(total / static_cast<float>(k) + fe);
      for (int64_t e = 0; e < k; ++e) hp[r * k + e] = wp[e] * (s[e] * inv);
    }
  });
  return {run_block_linear(hp, m, k, packed, format, -1), summed};
}

// The MLP's down projection, one call: x [M, 2K] (gate | up) -> block_linear(silu(gate) * up), with
// silu(g) = g / (1 + exp(-g)).
torch::Tensor silu_mul_block_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t format) {
  const auto xc = float_rows(x, "silu_mul_block_linear");
  const int64_t m = xc.size(0), k = xc.size(1) / 2;
  check_packed(packed, format, k);
  auto h = torch::empty({m, k}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  // Over elements, not rows: a verify step's few rows are thousands of exp calls.
  at::parallel_for(0, m * k, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0, r = i0 / k, e = i0 % k; i < i1; ++i) {
      const float g = xp[r * 2 * k + e];
      hp[i] = (g / (1.f + std::exp(-g))) * xp[r * 2 * k + k + e];
      if (++e == k) e = 0, ++r;
    }
  });
  return run_block_linear(hp, m, k, packed, format, -1);
}

// The paths this CPU runs (0 scalar, 1 AVX2, 2 AVX-512 VNNI), best last.
std::vector<int64_t> block_linear_paths() {
  std::vector<int64_t> out;
  for (int path : {kScalar, kAvx2, kAvx512Vnni})
    if (path_supported(path)) out.push_back(path);
  return out;
}
