// uniform_fill.cpp: sfc64_uniform_fill (see uniform_fill.h). One generator is a serial recurrence,
// so the speed comes from running four generators at once in the four 64-bit lanes of an AVX2
// register (when the processor has AVX2), then a 4 x 4 transpose gives each generator its own run
// of outputs. Generators left over (G not a multiple of 4) and processors without AVX2 use the
// scalar generator. Either way the values are mapped to floats in blocks, with vector
// instructions, straight into the rows of `out`.
#include "uniform_fill.h"

#include "nalu_cpu.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define NALU_FILL_HAVE_SSE2 1
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NALU_FILL_HAVE_AVX2 1
#endif

// The mapping must round after each operation, as numpy does: never fuse (f - 1) * w + lo into an
// FMA, whatever -march the file is compiled with.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace nalu_cuda {
namespace cpu {
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

// Where a generator's next value goes: (row, col) of a (rows, n) block with row stride `stride`.
struct Cursor {
  float* base;
  int64_t n, stride, row, col;
};

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
#pragma GCC target("avx2")

// Four generators, one per 64-bit lane.
struct Sfc64x4 {
  __m256i a, b, c, w;
  inline __m256i next() {
    const __m256i tmp = _mm256_add_epi64(_mm256_add_epi64(a, b), w);
    w = _mm256_add_epi64(w, _mm256_set1_epi64x(1));
    a = _mm256_xor_si256(b, _mm256_srli_epi64(b, 11));
    b = _mm256_add_epi64(c, _mm256_slli_epi64(c, 3));
    c = _mm256_add_epi64(_mm256_or_si256(_mm256_slli_epi64(c, 24), _mm256_srli_epi64(c, 40)), tmp);
    return tmp;
  }
};

void map_run_avx2(const uint32_t* words, float* dst, int64_t count, const Mapping& m) {
  const __m256i expo = _mm256_set1_epi32(0x3F800000);
  const __m256 one = _mm256_set1_ps(1.0f), width = _mm256_set1_ps(m.width), lo = _mm256_set1_ps(m.lo);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 f = _mm256_castsi256_ps(_mm256_or_si256(
        _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + i)), 9), expo));
    if (!m.raw) f = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(f, one), width), lo);
    _mm256_storeu_ps(dst + i, f);
  }
  for (; i < count; ++i) dst[i] = map_one(words[i], m);
}

// Generators state[0..3] fill starts[0..3] (same rows, n and row stride).
void fill_four_avx2(uint64_t* const state[4], const Cursor starts[4], int64_t total, const Mapping& m) {
  auto lane = [&](int k) {
    return _mm256_setr_epi64x(static_cast<int64_t>(state[0][k]), static_cast<int64_t>(state[1][k]),
                              static_cast<int64_t>(state[2][k]), static_cast<int64_t>(state[3][k]));
  };
  Sfc64x4 g{lane(0), lane(1), lane(2), lane(3)};
  Cursor c[4] = {starts[0], starts[1], starts[2], starts[3]};
  alignas(64) uint64_t buf[4][kSteps];
  for (int64_t left = total; left > 0;) {
    const int64_t words = std::min(left, kWords);
    const int64_t steps = (words + 1) / 2;
    int64_t i = 0;
    for (; i + 4 <= steps; i += 4) {
      // r_k holds step k of the four generators; transpose to four steps of each generator.
      const __m256i r0 = g.next(), r1 = g.next(), r2 = g.next(), r3 = g.next();
      const __m256i t0 = _mm256_unpacklo_epi64(r0, r1), t1 = _mm256_unpackhi_epi64(r0, r1);
      const __m256i t2 = _mm256_unpacklo_epi64(r2, r3), t3 = _mm256_unpackhi_epi64(r2, r3);
      _mm256_store_si256(reinterpret_cast<__m256i*>(&buf[0][i]), _mm256_permute2x128_si256(t0, t2, 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&buf[1][i]), _mm256_permute2x128_si256(t1, t3, 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&buf[2][i]), _mm256_permute2x128_si256(t0, t2, 0x31));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&buf[3][i]), _mm256_permute2x128_si256(t1, t3, 0x31));
    }
    for (; i < steps; ++i) {
      alignas(32) uint64_t r[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(r), g.next());
      for (int k = 0; k < 4; ++k) buf[k][i] = r[k];
    }
    for (int k = 0; k < 4; ++k) emit<map_run_avx2>(reinterpret_cast<const uint32_t*>(buf[k]), words, c[k], m);
    left -= words;
  }
  alignas(32) uint64_t s[4][4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(s[0]), g.a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(s[1]), g.b);
  _mm256_store_si256(reinterpret_cast<__m256i*>(s[2]), g.c);
  _mm256_store_si256(reinterpret_cast<__m256i*>(s[3]), g.w);
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 4; ++j) state[k][j] = s[j][k];
}

#pragma GCC pop_options
#endif  // NALU_FILL_HAVE_AVX2

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << " " << t.device() << " tensor of shape " << t.sizes() << " and strides " << t.strides();
  return s.str();
}

}  // namespace

void sfc64_uniform_fill(const at::Tensor& state, const at::Tensor& out, double lo, double hi, bool raw) {
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
  const int64_t total = rows * n;
  if (total == 0 || gens == 0) return;

  const Mapping m{static_cast<float>(hi - lo), static_cast<float>(lo), raw};
  auto* states = reinterpret_cast<uint64_t*>(state.data_ptr<int64_t>());
  float* data = out.data_ptr<float>();
  const int64_t row_stride = out.stride(0), gen_stride = batched ? out.stride(1) : 0;
  auto cursor = [&](int64_t g) { return Cursor{data + g * gen_stride, n, row_stride, 0, 0}; };

  int64_t g = 0;
#ifdef NALU_FILL_HAVE_AVX2
  if (use_avx2()) {
    for (; g + 4 <= gens; g += 4) {
      uint64_t* const st[4] = {states + 4 * g, states + 4 * (g + 1), states + 4 * (g + 2), states + 4 * (g + 3)};
      const Cursor starts[4] = {cursor(g), cursor(g + 1), cursor(g + 2), cursor(g + 3)};
      fill_four_avx2(st, starts, total, m);
    }
  }
#endif
  for (; g < gens; ++g) fill_one(states + 4 * g, cursor(g), total, m);
}

}  // namespace cpu
}  // namespace nalu_cuda
