// lstm_sequence_kernels.h: the elementwise work of the ensemble LSTM's sequence ops
// (lstm_sequence.cpp), included by it once per instruction set inside that set's namespace (base;
// avx2 under the AVX2 target) after every header it needs and LstmShape (the call's sizes): so no
// include guard and no includes here. The products with the state weights are ATen's (BLAS),
// between these passes, in lstm_sequence.cpp.
//
// PyTorch's LSTM equations, zero initial states, every step of the sequence:
//   z = x_t + h_{t-1} W                       (B, 4H), blocks i, f, g, o; W (H, 4H)
//   i, f, o = sigmoid(z_i, z_f, z_o)   g = tanh(z_g)
//   c_t = f c_{t-1} + i g               h_t = o tanh(c_t)
// The saved row of a (step, member, batch row) is [i f g o | c | tanh(c)] (6H), what the backward
// reads instead of recomputing a transcendental function. The gates' sigmoids are ATen's, over a
// step's whole (E, B, 4H) block at once (tanh(z) = 2 sigmoid(2 z) - 1 for the cell gate, its block
// doubled first: exact); these passes turn them into the gates and run the cell.

// The activations of one row: act[0 .. 4H) from s, the sigmoids of the row's z with the cell
// gate's block taken at 2 z (tanh(z) = 2 sigmoid(2 z) - 1), and the cell: c (H) carried (zero
// before the first step), h (H) written; act's row is 6H wide. (__restrict__: the rows never
// overlap, and gcc vectorises the cell's loop only when it knows.)
template <typename T>
void lstm_forward_row(int64_t H, const T* __restrict__ s, const T* __restrict__ scale, T* __restrict__ act,
                      T* __restrict__ c, T* __restrict__ h) {
  const int64_t G = 4 * H;
  const T one = T(1);
#pragma omp simd
  for (int64_t j = 0; j < G; ++j) {
    const T sc = scale[j];  // 1 (the sigmoid gates), 2 (the cell gate)
    act[j] = sc * s[j] - (sc - one);
  }
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const T cn = act[H + j] * c[j] + act[j] * act[2 * H + j];
    const T tc = math::tanh_(cn);
    act[G + j] = cn;
    act[G + H + j] = tc;
    c[j] = cn;
    h[j] = act[3 * H + j] * tc;
  }
}

// The backward of one row at one step: from dh (the output's gradient, that of step t plus the
// one carried back from step t + 1), the saved row r and the previous cell state cp (null at the
// first step), write dz (4H) and replace dc (H, carried back) by the cell state's gradient at t - 1.
template <typename T>
void lstm_backward_row(int64_t H, const T* __restrict__ dh_out, const T* __restrict__ dh_carry, const T* __restrict__ r,
                       const T* __restrict__ rp, T* __restrict__ dz, T* __restrict__ dc) {
  const int64_t G = 4 * H;
  const T one = T(1), zero = T(0);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const T gi = r[j], gf = r[H + j], gg = r[2 * H + j], go = r[3 * H + j], tc = r[G + H + j];
    const T cp = rp ? rp[G + j] : zero;
    const T dht = dh_out[j] + dh_carry[j];
    const T dcj = dc[j] + (dht * go) * (one - tc * tc);
    dz[j] = (dcj * gg) * (gi - gi * gi);
    dz[H + j] = (dcj * cp) * (gf - gf * gf);
    dz[2 * H + j] = (dcj * gi) * (one - gg * gg);
    dz[3 * H + j] = (dht * tc) * (go - go * go);
    dc[j] = dcj * gf;
  }
}

// One step of the forward for members [e0, e1): rows of sigmoids s (E, B, 4H) -> act (E, B, 6H), the cell
// states c (E, B, H, zero before the first step) and the outputs h (E, B, H).
template <typename T>
void lstm_forward_step(int64_t H, int64_t B, int64_t e0, int64_t e1, const T* s, const T* scale, T* act, T* c, T* h) {
  for (int64_t r = e0 * B; r < e1 * B; ++r)
    lstm_forward_row(H, s + r * 4 * H, scale, act + r * 6 * H, c + r * H, h + r * H);
}

// One step of the backward for members [e0, e1): the rows of saved (and of the previous step's,
// null at the first step), the outputs' gradient dh_out and the carried dh_carry (E, B, H) ->
// dz (E, B, 4H), dc (E, B, H) replaced.
template <typename T>
void lstm_backward_step(int64_t H, int64_t B, int64_t e0, int64_t e1, const T* dh_out, const T* dh_carry, const T* saved,
                        const T* saved_prev, T* dz, T* dc) {
  for (int64_t r = e0 * B; r < e1 * B; ++r)
    lstm_backward_row(H, dh_out + r * H, dh_carry + r * H, saved + r * 6 * H,
                      saved_prev ? saved_prev + r * 6 * H : nullptr, dz + r * 4 * H, dc + r * H);
}
