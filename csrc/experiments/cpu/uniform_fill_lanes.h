// uniform_fill_lanes.h: four SFC64 generators in the 64-bit lanes of one 256-bit register and the
// fill of their rows (uniform_fill.cpp), included by uniform_fill.cpp once per instruction set
// inside that set's namespace and target: avx2 (AVX2), and avx512 (AVX-512 VL: the rotation of the
// generator's c in one instruction, vprolq, instead of two shifts and an or). The same integer
// operations' results and the same float mapping: the same values in both. NALU_FILL_ROTL24(c), the
// rotation of c left by 24 bits, is defined before each inclusion; no include guard.

// Four generators, one per 64-bit lane.
struct Sfc64x4 {
  __m256i a, b, c, w;
  inline __m256i next() {
    const __m256i tmp = _mm256_add_epi64(_mm256_add_epi64(a, b), w);
    w = _mm256_add_epi64(w, _mm256_set1_epi64x(1));
    a = _mm256_xor_si256(b, _mm256_srli_epi64(b, 11));
    b = _mm256_add_epi64(c, _mm256_slli_epi64(c, 3));
    c = _mm256_add_epi64(NALU_FILL_ROTL24(c), tmp);
    return tmp;
  }
};

void map_run_lanes(const uint32_t* words, float* dst, int64_t count, const Mapping& m) {
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

// Generators state[0 .. 4 NG - 1] fill starts[0 .. 4 NG - 1] (same rows, n and row stride), NG
// groups of four lanes at once: one SFC64 step is a chain of dependent instructions, and two
// independent groups keep the vector units busy while each waits on its own chain.
template <int NG>
void fill_lanes(uint64_t* const* state, const Cursor* starts, int64_t total, const Mapping& m) {
  constexpr int G = 4 * NG;
  Sfc64x4 g[NG];
  for (int q = 0; q < NG; ++q) {
    auto lane = [&](int k) {
      return _mm256_setr_epi64x(static_cast<int64_t>(state[4 * q][k]), static_cast<int64_t>(state[4 * q + 1][k]),
                                static_cast<int64_t>(state[4 * q + 2][k]), static_cast<int64_t>(state[4 * q + 3][k]));
    };
    g[q] = Sfc64x4{lane(0), lane(1), lane(2), lane(3)};
  }
  Cursor c[G];
  for (int k = 0; k < G; ++k) c[k] = starts[k];
  alignas(64) uint64_t buf[G][kSteps];
  for (int64_t left = total; left > 0;) {
    const int64_t words = std::min(left, kWords);
    const int64_t steps = (words + 1) / 2;
    int64_t i = 0;
    for (; i + 4 <= steps; i += 4) {
      for (int q = 0; q < NG; ++q) {
        // r_k holds step k of the four generators; transpose to four steps of each generator.
        const __m256i r0 = g[q].next(), r1 = g[q].next(), r2 = g[q].next(), r3 = g[q].next();
        const __m256i t0 = _mm256_unpacklo_epi64(r0, r1), t1 = _mm256_unpackhi_epi64(r0, r1);
        const __m256i t2 = _mm256_unpacklo_epi64(r2, r3), t3 = _mm256_unpackhi_epi64(r2, r3);
        _mm256_store_si256(reinterpret_cast<__m256i*>(&buf[4 * q][i]), _mm256_permute2x128_si256(t0, t2, 0x20));
        _mm256_store_si256(reinterpret_cast<__m256i*>(&buf[4 * q + 1][i]), _mm256_permute2x128_si256(t1, t3, 0x20));
        _mm256_store_si256(reinterpret_cast<__m256i*>(&buf[4 * q + 2][i]), _mm256_permute2x128_si256(t0, t2, 0x31));
        _mm256_store_si256(reinterpret_cast<__m256i*>(&buf[4 * q + 3][i]), _mm256_permute2x128_si256(t1, t3, 0x31));
      }
    }
    for (; i < steps; ++i) {
      for (int q = 0; q < NG; ++q) {
        alignas(32) uint64_t r[4];
        _mm256_store_si256(reinterpret_cast<__m256i*>(r), g[q].next());
        for (int k = 0; k < 4; ++k) buf[4 * q + k][i] = r[k];
      }
    }
    for (int k = 0; k < G; ++k) emit<map_run_lanes>(reinterpret_cast<const uint32_t*>(buf[k]), words, c[k], m);
    left -= words;
  }
  for (int q = 0; q < NG; ++q) {
    alignas(32) uint64_t s[4][4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(s[0]), g[q].a);
    _mm256_store_si256(reinterpret_cast<__m256i*>(s[1]), g[q].b);
    _mm256_store_si256(reinterpret_cast<__m256i*>(s[2]), g[q].c);
    _mm256_store_si256(reinterpret_cast<__m256i*>(s[3]), g[q].w);
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < 4; ++j) state[4 * q + k][j] = s[j][k];
  }
}
