// Row-invariant CPU kernels: every output is one fixed-order reduction, whatever the rows beside it.
//
// A dot product sums into 16 lanes (lane j takes elements j, j + 16, ...) and then the lanes in
// order; attention reduces over a row's visible keys in sequence order. Tiling over rows and columns
// only changes which loads are shared, never an output's order of operations. Built for the machine
// that builds it (-march=native, by `make setup`) with -ffp-contract=off and without fast-math, so
// the vectorized code computes exactly the scalar semantics: the result is the same on every ISA
// (AVX-512, AVX2, SSE2), tile and thread count.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kLanes = 16;





















// The lanes of sum_k a[k] * b[k] over n elements: lane j accumulates k = j (mod 16).
template <typename T>
inline void dot_lanes_into(const float* a, const T* b, int64_t n, float* acc) {
  for (int j = 0; j < kLanes; ++j) acc[j] = 0.f;
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[k + j] * static_cast<float>(b[k + j]);
  }
  for (int j = 0; k + j < n; ++j) acc[j] += a[k + j] * static_cast<float>(b[k + j]);
}

// sum_k a[k] * b[k]: its lanes (dot_lanes_into), then the lanes in order.
template <typename T>
inline float dot_lanes(const float* a, const T* b, int64_t n) {
  float acc[kLanes];
  dot_lanes_into(a, b, n, acc);
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// dot_lanes of q against 16 keys: each key's lanes, then their in-order sums for the 16 keys
// together (a lone key's 16 in-order adds wait on each other).
template <typename T>
inline void dot_lanes_keys(const float* a, const T* keys, const int64_t* slots, int64_t stride, int64_t n,
                           float* out) {
  float acc[kLanes][kLanes];  // [key][lane]
  for (int c = 0; c < kLanes; ++c) dot_lanes_into(a, keys + slots[c] * stride, n, acc[c]);
  float s[kLanes] = {0.f};
  for (int j = 0; j < kLanes; ++j)
    for (int c = 0; c < kLanes; ++c) s[c] += acc[c][j];
  for (int c = 0; c < kLanes; ++c) out[c] = s[c];
}

// The 16 lanes as kParts native vectors (one zmm on AVX-512, two ymm on AVX2, four xmm otherwise):
// lane j is element j % kWidth of part j / kWidth; lane-wise mul and add only.
// The output tile (rows x weight rows) a thread computes at once: as many accumulators as the
// ISA's registers hold (32 zmm: 6 x 4; 16 ymm: 4 x 2 of two parts each).
#if defined(__AVX512F__)
constexpr int kWidth = 16, kTileR = 6, kTileC = 4;
#elif defined(__AVX__)
constexpr int kWidth = 8, kTileR = 4, kTileC = 2;
#else
constexpr int kWidth = 4, kTileR = 2, kTileC = 2;
#endif
constexpr int kParts = kLanes / kWidth;
typedef float vec __attribute__((vector_size(kWidth * sizeof(float))));

inline vec load_vec(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// R rows of x against C weight rows: out[r][c] = dot_lanes(x[r], w[c]) (lane j takes elements
// j, j + 16, ...; the lanes are summed in order at the end). The tile changes only which loads are
// shared, never an output's order of operations.
template <int R, int C>
inline void dot_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t n, float* out,
                     int64_t ldo) {
  vec acc[R][C][kParts];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int p = 0; p < kParts; ++p) acc[r][c][p] = vec{};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int p = 0; p < kParts; ++p) {
      vec wv[C];
      for (int c = 0; c < C; ++c) wv[c] = load_vec(w + c * ldw + k + p * kWidth);
      for (int r = 0; r < R; ++r) {
        const vec xv = load_vec(x + r * ldx + k + p * kWidth);
        for (int c = 0; c < C; ++c) acc[r][c][p] += xv * wv[c];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float lanes[kLanes];
      __builtin_memcpy(lanes, acc[r][c], sizeof(lanes));
      for (int j = 0; k + j < n; ++j) lanes[j] += x[r * ldx + k + j] * w[c * ldw + k + j];
      float s = 0.f;
      for (int j = 0; j < kLanes; ++j) s += lanes[j];
      out[r * ldo + c] = s;
    }
  }
}

constexpr int64_t kRowBlock = 36;  // rows of x kept in cache while a thread sweeps its columns

void linear_columns(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n0, int64_t n1,
                    int64_t n) {
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t r1 = r0 + kRowBlock < m ? r0 + kRowBlock : m;
    int64_t col = n0;
    for (; col + kTileC <= n1; col += kTileC) {
      const float* wr = w + col * k;
      int64_t row = r0;
      for (; row + kTileR <= r1; row += kTileR) dot_tile<kTileR, kTileC>(x + row * k, k, wr, k, k, y + row * n + col, n);
      for (; row < r1; ++row) dot_tile<1, kTileC>(x + row * k, k, wr, k, k, y + row * n + col, n);
    }
    for (; col < n1; ++col) {
      const float* wr = w + col * k;
      int64_t row = r0;
      for (; row + kTileR <= r1; row += kTileR) dot_tile<kTileR, 1>(x + row * k, k, wr, k, k, y + row * n + col, n);
      for (; row < r1; ++row) dot_tile<1, 1>(x + row * k, k, wr, k, k, y + row * n + col, n);
    }
  }
}

// One query row and head (q in float32) over its visible keys (cache slots, in sequence order);
// out [d] float32.
template <typename T>
void attend_row(const float* q, const T* keys, const T* values, const int64_t* slots,
                                     int64_t count, int64_t stride, int64_t d, float scale, float* scores,
                                     float* out) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t l = 0;
  for (; l + kLanes <= count; l += kLanes) dot_lanes_keys(q, keys, slots + l, stride, d, scores + l);
  for (; l < count; ++l) scores[l] = dot_lanes(q, keys + slots[l] * stride, d);
  for (l = 0; l < count; ++l) {
    scores[l] *= scale;
    top = scores[l] > top ? scores[l] : top;
  }
  float total = 0.f;
  for (int64_t l = 0; l < count; ++l) {
    scores[l] = std::exp(scores[l] - top);
    total += scores[l];
  }
  int64_t i0 = 0;
  if constexpr (std::is_same_v<T, float>) {
    // 64 outputs at a time in registers (each still sums its keys in sequence order): accumulating
    // in ``out`` put a store and a reload between every two keys.
    constexpr int kChunk = 64, kVecs = kChunk / kWidth;
    for (; i0 + kChunk <= d; i0 += kChunk) {
      vec acc[kVecs] = {};
      for (int64_t l = 0; l < count; ++l) {
        const float* v = values + slots[l] * stride + i0;
        const vec p = vec{} + scores[l];
        for (int c = 0; c < kVecs; ++c) acc[c] += p * load_vec(v + c * kWidth);
      }
      __builtin_memcpy(out + i0, acc, sizeof(acc));
    }
  }
  for (int64_t i = i0; i < d; ++i) out[i] = 0.f;
  for (int64_t l = 0; l < count && i0 < d; ++l) {
    const T* v = values + slots[l] * stride;
    const float p = scores[l];
    for (int64_t i = i0; i < d; ++i) out[i] += p * static_cast<float>(v[i]);
  }
  for (int64_t i = 0; i < d; ++i) out[i] /= total;
}

}  // namespace

// x [M, K] float32 @ w [N, K].T -> [M, N] float32; parallel over output columns.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "linear: float32 only");
  TORCH_CHECK(w.is_contiguous(), "linear: w must be row-major contiguous [N, K]");
  const auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = w.size(0);
  auto y = torch::empty({m, n}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) { linear_columns(xp, wp, yp, m, k, n0, n1, n); });
  return y;
}

// Paged attention, one row at a time. q [T, Hq, d]; cache [2, pages, page_size, Hkv, d] (K/V of
// this step already written, q's dtype); row_req / row_idx [T]: each row's request and index in its
// new block; page_table [B, max_pages]; kv_lens / q_lens [B]; tree_mask [B, Qm, Qm] bool, or empty
// for causal. Row (b, i) sees kv 0 .. kv_lens[b] - q_lens[b] - 1 and block column j where the mask
// allows (causal: j <= i), in that order. Sums in float32; the output is rounded to q's dtype.
template <typename T>
void paged_attention_impl(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& req,
                          const torch::Tensor& idx, const torch::Tensor& table, const torch::Tensor& kvl,
                          const torch::Tensor& ql, const torch::Tensor& mask, float scale, torch::Tensor& out) {
  const int64_t t = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t pages = cache.size(1), ps = cache.size(2), hkv = cache.size(3);
  const bool tree = mask.numel() > 0;
  const int64_t qm = tree ? mask.size(1) : 0;
  const T* qp = q.data_ptr<T>();
  const T* keys = cache.data_ptr<T>();
  const T* values = keys + pages * ps * hkv * d;
  const int64_t* reqp = req.data_ptr<int64_t>();
  const int64_t* idxp = idx.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* kvp = kvl.data_ptr<int64_t>();
  const int64_t* qlp = ql.data_ptr<int64_t>();
  const bool* mp = tree ? mask.data_ptr<bool>() : nullptr;
  const int64_t max_pages = table.size(1), group = hq / hkv, stride = hkv * d;
  T* op = out.data_ptr<T>();
  for (int64_t row = 0; row < t; ++row)
    TORCH_CHECK(kvp[reqp[row]] <= max_pages * ps, "paged_attention: kv index past the page table");
  // One task per (row, query head), so a one-row step spreads its heads over the threads; a task's
  // visible slots come page by page (no division per key). Which thread runs a task never changes
  // its numbers.
  at::parallel_for(0, t * hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots;
    std::vector<float> scores, qf(d), of(d);
    int64_t listed = -1;  // the row whose visible slots ``slots`` holds
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / hq, h = task % hq, kh = h / group, b = reqp[row], i = idxp[row];
      if (row != listed) {
        const int64_t prefix = kvp[b] - qlp[b];
        const bool* visible = tree ? mp + (b * qm + i) * qm : nullptr;
        slots.clear();
        for (int64_t l0 = 0; l0 < kvp[b]; l0 += ps) {
          const int64_t base = tp[b * max_pages + l0 / ps] * ps - l0, l1 = std::min(l0 + ps, kvp[b]);
          for (int64_t l = l0; l < l1; ++l) {
            const int64_t j = l - prefix;
            if (j >= 0 && (tree ? !visible[j] : j > i)) continue;
            slots.push_back(base + l);
          }
        }
        scores.resize(slots.size());
        listed = row;
      }
      for (int64_t e = 0; e < d; ++e) qf[e] = static_cast<float>(qp[(row * hq + h) * d + e]);
      attend_row<T>(qf.data(), keys + kh * d, values + kh * d, slots.data(), static_cast<int64_t>(slots.size()),
                    stride, d, scale, scores.data(), of.data());
      for (int64_t e = 0; e < d; ++e) op[(row * hq + h) * d + e] = static_cast<T>(of[e]);
    }
  });
}

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& row_req,
                              const torch::Tensor& row_idx, const torch::Tensor& page_table,
                              const torch::Tensor& kv_lens, const torch::Tensor& q_lens,
                              const torch::Tensor& tree_mask, double scale) {
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "paged_attention: q and the cache share a dtype");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && q.dim() == 3, "paged_attention: q [T, Hq, d], cache [2, pages, ps, Hkv, d]");
  TORCH_CHECK(cache.size(4) == q.size(2) && q.size(1) % cache.size(3) == 0, "paged_attention: head shapes");
  TORCH_CHECK(tree_mask.numel() == 0 || tree_mask.scalar_type() == torch::kBool, "paged_attention: bool tree mask");
  const auto qc = q.contiguous();
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, qc.scalar_type(), "paged_attention", [&] {
    paged_attention_impl<scalar_t>(qc, cache, row_req.contiguous(), row_idx.contiguous(), page_table.contiguous(),
                                   kv_lens.contiguous(), q_lens.contiguous(), tree_mask.contiguous(),
                                   static_cast<float>(scale), out);
  });
  return out;
}

// The step's rows rotated (rotate-half RoPE) and its K/V written into the cache, then
// paged_attention, in one call. q [T, Hq, d], k / v [T, Hkv, d] (rows may be strided, each head's
// d values contiguous: views of the fused qkv projection); cos / sin [T, 1, d / 2] float32 (empty: no
// RoPE); slots [T] int64: each row's flat cache slot. RoPE as ``attention.sdpa.rotate_half``:
// (x1 c - x2 s, x2 c + x1 s) in float32, each product and sum rounded once, then rounded to q's dtype.
template <typename T>
void rope_write(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                const torch::Tensor& sin, const torch::Tensor& slots, torch::Tensor& cache, torch::Tensor& qr) {
  const int64_t t = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2), half = d / 2;
  const int64_t pages = cache.size(1), ps = cache.size(2);
  const bool rope = cos.numel() > 0;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const float* cp = rope ? cos.data_ptr<float>() : nullptr;
  const float* sp = rope ? sin.data_ptr<float>() : nullptr;
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* keys = cache.data_ptr<T>();
  T* values = keys + pages * ps * hkv * d;
  T* out = qr.data_ptr<T>();
  const int64_t sq = q.stride(0), sk = k.stride(0), sv = v.stride(0);
  auto rotate = [&](const T* x, const float* c, const float* s, T* y) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
      y[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
      y[i + half] = static_cast<T>(x2 * c[i] + x1 * s[i]);
    }
  };
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      TORCH_CHECK(slot[r] >= 0 && slot[r] < pages * ps, "rope_paged_attention: slot outside the cache");
      for (int64_t h = 0; h < hq; ++h) {
        const T* x = qp + r * sq + h * d;
        T* y = out + (r * hq + h) * d;
        if (rope)
          rotate(x, cp + r * half, sp + r * half, y);
        else
          std::copy(x, x + d, y);
      }
      for (int64_t h = 0; h < hkv; ++h) {
        const T* x = kp + r * sk + h * d;
        T* y = keys + (slot[r] * hkv + h) * d;
        if (rope)
          rotate(x, cp + r * half, sp + r * half, y);
        else
          std::copy(x, x + d, y);
        std::copy(vp + r * sv + h * d, vp + r * sv + (h + 1) * d, values + (slot[r] * hkv + h) * d);
      }
    }
  });
}

torch::Tensor rope_paged_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                                   torch::Tensor cache, const torch::Tensor& row_req, const torch::Tensor& row_idx,
                                   const torch::Tensor& page_table, const torch::Tensor& kv_lens,
                                   const torch::Tensor& q_lens, const torch::Tensor& tree_mask, double scale) {
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && k.scalar_type() == cache.scalar_type() &&
                  v.scalar_type() == cache.scalar_type(),
              "rope_paged_attention: q, k, v and the cache share a dtype");
  TORCH_CHECK(cache.is_contiguous() && cache.dim() == 5 && q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "rope_paged_attention: q [T, Hq, d], k / v [T, Hkv, d], cache [2, pages, ps, Hkv, d]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == cache.size(3) &&
                  q.size(2) == cache.size(4) && k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0 &&
                  q.size(2) % 2 == 0,
              "rope_paged_attention: head shapes");
  for (const auto* x : {&q, &k, &v})
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2), "rope_paged_attention: heads contiguous per row");
  const bool rope = cos.numel() > 0;
  TORCH_CHECK(!rope || (cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
                        cos.numel() == q.size(0) * q.size(2) / 2 && sin.numel() == cos.numel()),
              "rope_paged_attention: cos / sin [T, 1, d / 2] float32");
  TORCH_CHECK(slots.numel() == q.size(0), "rope_paged_attention: one slot per row");
  TORCH_CHECK(tree_mask.numel() == 0 || tree_mask.scalar_type() == torch::kBool, "rope_paged_attention: bool tree mask");
  const auto cc = cos.contiguous(), sc = sin.contiguous(), slc = slots.contiguous();
  auto qr = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto out = torch::empty_like(qr);
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, q.scalar_type(), "rope_paged_attention", [&] {
    rope_write<scalar_t>(q, k, v, cc, sc, slc, cache, qr);
    paged_attention_impl<scalar_t>(qr, cache, row_req.contiguous(), row_idx.contiguous(), page_table.contiguous(),
                                   kv_lens.contiguous(), q_lens.contiguous(), tree_mask.contiguous(),
                                   static_cast<float>(scale), out);
  });
  return out;
}

// quant_kernels.cpp
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t format, int64_t path);
std::vector<int64_t> block_linear_paths();
std::vector<torch::Tensor> rmsnorm_block_linear(const torch::Tensor& x, const torch::Tensor& residual,
                                                const torch::Tensor& weight, double eps,
                                                const torch::Tensor& packed, int64_t format);
torch::Tensor silu_mul_block_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t format);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ w.T, every output one fixed-order dot (float32)");
  m.def("paged_attention", &paged_attention, "paged attention, every row reduced in sequence order");
  m.def("block_linear", &block_linear, "x against Q4_1 / Q8_0 weight blocks, activations as int8 blocks");
  m.def("block_linear_paths", &block_linear_paths, "the ISA paths of block_linear this CPU runs");
  m.def("rmsnorm_block_linear", &rmsnorm_block_linear, "residual add + RMSNorm + block_linear");
  m.def("silu_mul_block_linear", &silu_mul_block_linear, "SiLU(gate) * up + block_linear");
  m.def("rope_paged_attention", &rope_paged_attention, "RoPE, the step's K/V written, paged attention");
}
