// uniform_fill.cpp: sfc64_uniform_fill (see uniform_fill.h). One generator is a serial recurrence,
// so the speed comes from running four generators at once in the four 64-bit lanes of an AVX2
// register (when the processor has AVX2), then a 4 x 4 transpose gives each generator its own run
// of outputs. Generators left over (G not a multiple of 4) and processors without AVX2 use the
// scalar generator. Either way the values are mapped to floats in blocks, with vector
// instructions, straight into the rows of `out`.
#include "experiments/cpu/uniform_fill.h"

#include "common/cpu/isa.h"  // use_avx2(), use_avx512()
#include "experiments/cpu/fp_contract.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#if defined(__GNUC__)
#define NALU_HOST_INLINE_FILL inline __attribute__((always_inline))
#else
#define NALU_HOST_INLINE_FILL inline
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define NALU_FILL_HAVE_SSE2 1
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NALU_FILL_HAVE_AVX2 1
#endif

// The mapping must round after each operation, as numpy does: never fuse (f - 1) * w + lo into an
// FMA, whatever -march the file is compiled with.
NALU_FP_CONTRACT_OFF

namespace nalu_cuda {
namespace training {
namespace {

// numpy/random/src/sfc64/sfc64.h: s[0..2] = a, b, c; s[3] = w, the counter.
struct Sfc64 {
  uint64_t a, b, c, w;
  inline uint64_t next() {
    const uint64_t tmp = a + b + w++;
    a = b ^ (b >> 11);
    b = c + (c << 3);
    c = ((c << 24) | (c >> 40)) + tmp;
    return tmp;
  }
};

struct Mapping {
  float width, lo;
  bool raw;
};

// Weighted sums over the segments of a finished row (the optional `weights`/`sums` of
// sfc64_uniform_fill): generator g's row `row` of n values is n / seg segments; segment b gets
// sums[row, g, b, k] = sum_i x[b * seg + i] * weights[g, i, k] in float64, over i in the span of
// nonzero weights of (g, k) only (for the static task's contiguous subsets, the subset itself).
struct RowSums {
  const double* weights;  // (G, K, seg): transposed from the caller's (G, seg, K)
  const int64_t* spans;   // (G, K, 2): [first, last + 1) of the nonzero weights
  const uint8_t* unit;    // (G,): every weight inside every span of the generator is 1 (a plain sum)
  double* out;            // (rows, G, n / seg, K)
  int64_t gens, seg, K, segs;
  void (*reduce)(const RowSums&, const float*, int64_t g, int64_t row);
};

// Where a generator's next value goes: (row, col) of a (rows, n) block with row stride `stride`;
// `sums` (or null) is told of each finished row.
struct Cursor {
  float* base;
  int64_t n, stride, row, col;
  int64_t gen;
  const RowSums* sums;
};

// The sums of one finished row, read back while it is still in cache. Each is exact (so
// independent of the order of its terms) whenever the inputs lie on a grid fine enough for
// float64 to hold the sum, as the values of every uniform range of the experiments do.
NALU_HOST_INLINE_FILL void reduce_row_impl(const RowSums& s, const float* x, int64_t g, int64_t row) {
  const double* w = s.weights + g * s.seg * s.K;
  const int64_t* span = s.spans + g * s.K * 2;
  double* out = s.out + (row * s.gens + g) * s.segs * s.K;
  if (s.unit[g]) {  // subsets (the static task's): each sum over its own span, no products
    typedef float f4 __attribute__((vector_size(16), aligned(4), may_alias));
    typedef double d4 __attribute__((vector_size(32)));
    for (int64_t b = 0; b < s.segs; ++b) {
      const float* xb = x + b * s.seg;
      for (int64_t k = 0; k < s.K; ++k) {
        // four partial sums and a short tree at the end (an omp simd reduction here ended in eight
        // dependent scalar additions per sum, most of this function's time)
        d4 acc = {0.0, 0.0, 0.0, 0.0};
        int64_t i = span[2 * k];
        const int64_t end = span[2 * k + 1];
        for (; i + 4 <= end; i += 4) acc += __builtin_convertvector(*reinterpret_cast<const f4*>(xb + i), d4);
        double sum = (acc[0] + acc[2]) + (acc[1] + acc[3]);
        for (; i < end; ++i) sum += static_cast<double>(xb[i]);
        out[b * s.K + k] = sum;
      }
    }
    return;
  }
  if (s.K == 2) {  // a and b of the static task: one pass over the union of the two spans,
    // widened over zero weights to a multiple of 8 where the segment allows (no scalar remainder)
    int64_t i0 = std::min(span[0], span[2]), i1 = std::max(span[1], span[3]);
    const int64_t len = std::min(s.seg, (i1 - i0 + 7) / 8 * 8);
    i1 = std::min(s.seg, i0 + len);
    i0 = i1 - len;
    const double *w0 = w, *w1 = w + s.seg;
    for (int64_t b = 0; b < s.segs; ++b) {
      const float* xb = x + b * s.seg;
      double a0 = 0.0, a1 = 0.0;
#pragma omp simd reduction(+ : a0, a1)
      for (int64_t i = i0; i < i1; ++i) {
        const double v = static_cast<double>(xb[i]);
        a0 += v * w0[i];
        a1 += v * w1[i];
      }
      out[2 * b] = a0;
      out[2 * b + 1] = a1;
    }
    return;
  }
  for (int64_t b = 0; b < s.segs; ++b) {
    const float* xb = x + b * s.seg;
    for (int64_t k = 0; k < s.K; ++k) {
      double acc = 0.0;
      const double* wk = w + k * s.seg;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = span[2 * k]; i < span[2 * k + 1]; ++i) acc += static_cast<double>(xb[i]) * wk[i];
      out[b * s.K + k] = acc;
    }
  }
}

void reduce_row(const RowSums& s, const float* x, int64_t g, int64_t row) { reduce_row_impl(s, x, g, row); }

constexpr int64_t kSteps = 64;             // 64-bit outputs per block and generator
constexpr int64_t kWords = 2 * kSteps;     // values per block

inline float map_one(uint32_t u, const Mapping& m) {
  const uint32_t bits = (u >> 9) | 0x3F800000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  if (!m.raw) {
    f = f - 1.0f;
    f = f * m.width;
    f = f + m.lo;
  }
  return f;
}

// Maps `count` words into consecutive elements of one row.
void map_run(const uint32_t* words, float* dst, int64_t count, const Mapping& m) {
  int64_t i = 0;
#ifdef NALU_FILL_HAVE_SSE2
  const __m128i expo = _mm_set1_epi32(0x3F800000);
  const __m128 one = _mm_set1_ps(1.0f), width = _mm_set1_ps(m.width), lo = _mm_set1_ps(m.lo);
  for (; i + 4 <= count; i += 4) {
    __m128 f = _mm_castsi128_ps(
        _mm_or_si128(_mm_srli_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words + i)), 9), expo));
    if (!m.raw) f = _mm_add_ps(_mm_mul_ps(_mm_sub_ps(f, one), width), lo);
    _mm_storeu_ps(dst + i, f);
  }
#endif
  for (; i < count; ++i) dst[i] = map_one(words[i], m);
}

using MapRun = void (*)(const uint32_t*, float*, int64_t, const Mapping&);

// Maps `count` words to the next values of a generator's rows, one run per row with `Run`.
template <MapRun Run>
void emit(const uint32_t* words, int64_t count, Cursor& c, const Mapping& m) {
  while (count > 0) {
    const int64_t k = std::min(count, c.n - c.col);
    Run(words, c.base + c.row * c.stride + c.col, k, m);
    words += k;
    count -= k;
    c.col += k;
    if (c.col == c.n) {
      if (c.sums != nullptr) c.sums->reduce(*c.sums, c.base + c.row * c.stride, c.gen, c.row);
      c.col = 0;
      ++c.row;
    }
  }
}

void fill_one(uint64_t* state, const Cursor& start, int64_t total, const Mapping& m) {
  Sfc64 g{state[0], state[1], state[2], state[3]};
  Cursor c = start;
  alignas(64) uint64_t buf[kSteps];
  for (int64_t left = total; left > 0;) {
    const int64_t words = std::min(left, kWords);
    const int64_t steps = (words + 1) / 2;
    for (int64_t i = 0; i < steps; ++i) buf[i] = g.next();
    emit<map_run>(reinterpret_cast<const uint32_t*>(buf), words, c, m);  // little-endian: low half first
    left -= words;
  }
  state[0] = g.a;
  state[1] = g.b;
  state[2] = g.c;
  state[3] = g.w;
}

#ifdef NALU_FILL_HAVE_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")

void reduce_row_avx2(const RowSums& s, const float* x, int64_t g, int64_t row) { reduce_row_impl(s, x, g, row); }

namespace avx2 {
#define NALU_FILL_ROTL24(c) _mm256_or_si256(_mm256_slli_epi64(c, 24), _mm256_srli_epi64(c, 40))
#include "experiments/cpu/uniform_fill_lanes.h"
#undef NALU_FILL_ROTL24
}  // namespace avx2

#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vl")
namespace avx512 {
#define NALU_FILL_ROTL24(c) _mm256_rol_epi64(c, 24)
#include "experiments/cpu/uniform_fill_lanes.h"
#undef NALU_FILL_ROTL24
}  // namespace avx512
#pragma GCC pop_options
#endif  // NALU_FILL_HAVE_AVX2

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << " " << t.device() << " tensor of shape " << t.sizes() << " and strides " << t.strides();
  return s.str();
}

}  // namespace

void sfc64_uniform_fill(const at::Tensor& state, const at::Tensor& out, double lo, double hi, bool raw,
                        const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& sums) {
  constexpr const char* kFn = "sfc64_uniform_fill";
  TORCH_CHECK(state.defined() && out.defined(), kFn, ": state and out must be tensors, got an undefined one");
  TORCH_CHECK(state.device().is_cpu() && state.scalar_type() == at::kLong && state.is_contiguous() &&
                  (state.dim() == 1 || state.dim() == 2) && state.size(-1) == 4,
              kFn, ": state must be a contiguous int64 CPU tensor of shape (4,) or (G, 4) (numpy's SFC64 ",
              "uint64 state viewed as int64), got a ", describe(state));
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat, kFn,
              ": out must be a float32 CPU tensor, got a ", describe(out));
  const bool batched = state.dim() == 2;
  const int64_t want_dim = batched ? 3 : 2;
  TORCH_CHECK(out.dim() == want_dim, kFn, ": out must be ", batched ? "3-D (rows, G, n) for a state of shape (G, 4)"
                                                                    : "2-D (rows, n) for a state of shape (4,)",
              ", got a ", describe(out));
  const int64_t gens = batched ? state.size(0) : 1;
  TORCH_CHECK(!batched || out.size(1) == gens, kFn, ": out must have one column block per generator: size(1) ",
              "must be G = ", gens, " (state is ", state.sizes(), "), got a ", describe(out));
  const int64_t rows = out.size(0), n = out.size(-1);
  TORCH_CHECK(n <= 1 || out.stride(-1) == 1, kFn, ": out's last dimension must be contiguous (stride 1), got a ",
              describe(out));
  TORCH_CHECK(raw || (std::isfinite(lo) && std::isfinite(hi)), kFn, ": lo and hi must be finite, got lo = ", lo,
              ", hi = ", hi);
  TORCH_CHECK(weights.has_value() == sums.has_value(), kFn, ": weights and sums come together, got ",
              weights.has_value() ? "weights without sums" : "sums without weights");
  const double* wp = nullptr;
  int64_t seg = 1, K = 0;
  if (weights.has_value()) {
    const at::Tensor& w = *weights;
    const at::Tensor& o = *sums;
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kDouble && w.is_contiguous() && w.dim() == 3 &&
                    w.size(0) == gens && w.size(1) >= 1,
                kFn, ": weights must be a contiguous float64 CPU tensor of shape (G, seg, K) with G = ", gens,
                " and seg >= 1, got a ", describe(w));
    seg = w.size(1), K = w.size(2);
    TORCH_CHECK(n % seg == 0, kFn, ": out's rows of n = ", n, " values must split into segments of seg = ", seg,
                " (weights.size(1)), got a remainder of ", n % seg);
    const int64_t segs = n / seg;
    TORCH_CHECK(o.device().is_cpu() && o.scalar_type() == at::kDouble && o.is_contiguous() && o.dim() == 4 &&
                    o.size(0) == rows && o.size(1) == gens && o.size(2) == segs && o.size(3) == K,
                kFn, ": sums must be a contiguous float64 CPU tensor of shape (rows, G, n / seg, K) = (", rows, ", ",
                gens, ", ", segs, ", ", K, "), got a ", describe(o));
    TORCH_CHECK(batched, kFn, ": weights and sums need a state of shape (G, 4), got ", state.sizes());
    wp = w.const_data_ptr<double>();
  }
  const FillBlocks f{gens, rows, n, batched ? out.stride(1) : 0, out.stride(0), lo, hi, raw, wp, seg, K,
                     weights.has_value() ? sums->data_ptr<double>() : nullptr};
  sfc64_fill_blocks(reinterpret_cast<uint64_t*>(state.data_ptr<int64_t>()), out.data_ptr<float>(), f);
}

void sfc64_fill_blocks(uint64_t* states, float* data, const FillBlocks& f) {
  const int64_t gens = f.gens, seg = f.seg, K = f.K;
  RowSums rs{};
  std::vector<int64_t> spans;
  std::vector<double> wt;
  std::vector<uint8_t> unit;
  if (f.weights != nullptr) {
    const double* wp = f.weights;
    spans.resize(static_cast<size_t>(gens * K * 2));
    wt.resize(static_cast<size_t>(gens * K * seg));
    for (int64_t g = 0; g < gens; ++g) {
      for (int64_t k = 0; k < K; ++k) {
        int64_t first = seg, last = -1;
        for (int64_t i = 0; i < seg; ++i) {
          wt[(g * K + k) * seg + i] = wp[(g * seg + i) * K + k];
          if (wp[(g * seg + i) * K + k] != 0.0) {
            first = std::min(first, i);
            last = i;
          }
        }
        spans[(g * K + k) * 2] = last < 0 ? 0 : first;
        spans[(g * K + k) * 2 + 1] = last < 0 ? 0 : last + 1;
      }
    }
    unit.assign(static_cast<size_t>(gens), 1);
    for (int64_t g = 0; g < gens; ++g)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t i = spans[(g * K + k) * 2]; i < spans[(g * K + k) * 2 + 1]; ++i)
          if (wt[(g * K + k) * seg + i] != 1.0) unit[g] = 0;
    rs = RowSums{wt.data(), spans.data(), unit.data(), f.sums, gens, seg, K, f.n / seg, &reduce_row};
#ifdef NALU_FILL_HAVE_AVX2
    if (cpu::use_avx2()) rs.reduce = &reduce_row_avx2;
#endif
  }
  const RowSums* row_sums = f.weights != nullptr ? &rs : nullptr;
  const int64_t total = f.rows * f.n;
  if (total == 0 || gens == 0) return;

  const Mapping m{static_cast<float>(f.hi - f.lo), static_cast<float>(f.lo), f.raw};
  auto cursor = [&](int64_t g) { return Cursor{data + g * f.gen_stride, f.n, f.row_stride, 0, 0, g, row_sums}; };

  int64_t g = 0;
#ifdef NALU_FILL_HAVE_AVX2
  if (cpu::use_avx2()) {
    uint64_t* st[8];
    Cursor starts[8];
    auto prepare = [&](int k) {
      for (int j = 0; j < k; ++j) {
        st[j] = states + 4 * (g + j);
        starts[j] = cursor(g + j);
      }
    };
    const bool rol = cpu::use_avx512();
    for (; g + 8 <= gens; g += 8) {
      prepare(8);
      rol ? avx512::fill_lanes<2>(st, starts, total, m) : avx2::fill_lanes<2>(st, starts, total, m);
    }
    for (; g + 4 <= gens; g += 4) {
      prepare(4);
      rol ? avx512::fill_lanes<1>(st, starts, total, m) : avx2::fill_lanes<1>(st, starts, total, m);
    }
  }
#endif
  for (; g < gens; ++g) fill_one(states + 4 * g, cursor(g), total, m);
}

}  // namespace training
}  // namespace nalu_cuda
