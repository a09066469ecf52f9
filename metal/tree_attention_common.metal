// Shared by the tree-attention bodies (the `header` of every mx.fast.metal_kernel here).
//
// One simdgroup (32 lanes) attends one block row for one query head; lane i holds head-dim
// elements [i * E, (i + 1) * E), E = D / 32. Softmax is online: (m, l, acc) are the running
// maximum, the running sum of exp(score - m) and the running weighted sum of value rows.

// Loads the lane's slice of a query row, pre-scaled, and clears its accumulator.
template <typename T, int E>
inline void load_query(thread float* qv, thread float* acc, const device T* qp, float scale,
                       uint lane) {
  for (int e = 0; e < E; e++) {
    qv[e] = float(qp[lane * E + e]) * scale;
    acc[e] = 0.0f;
  }
}

// Folds key / value row s into the lane's online-softmax state.
template <typename T, int E>
inline void attend_key(thread const float* qv, thread float* acc, thread float& m,
                       thread float& l, const device T* kp, const device T* vp, uint lane) {
  float d = 0.0f;
  for (int e = 0; e < E; e++) {
    d += qv[e] * float(kp[lane * E + e]);
  }
  d = simd_sum(d);
  float m_new = metal::max(m, d);
  float correction = metal::exp(m - m_new);
  float p = metal::exp(d - m_new);
  l = l * correction + p;
  for (int e = 0; e < E; e++) {
    acc[e] = acc[e] * correction + p * float(vp[lane * E + e]);
  }
  m = m_new;
}

// Folds keys [lo, hi) of [committed context + block]. Committed positions are always visible,
// so that part runs without a mask test; block column j = s - context is visible when bit j of
// the row's ancestor bits is set (bit j % 32 of word j / 32).
template <typename T, int E>
inline void attend_range(thread const float* qv, thread float* acc, thread float& m,
                         thread float& l, int lo, int hi, int context,
                         const device uint* row_bits, const device T* kb, const device T* vb,
                         int64_t k_step, int64_t v_step, uint lane) {
  int committed_end = metal::min(hi, context);
  for (int s = lo; s < committed_end; s++) {
    attend_key<T, E>(qv, acc, m, l, kb + s * k_step, vb + s * v_step, lane);
  }
  for (int s = metal::max(lo, context); s < hi; s++) {
    int j = s - context;
    if (((row_bits[j >> 5] >> (j & 31)) & 1u) != 0u) {
      attend_key<T, E>(qv, acc, m, l, kb + s * k_step, vb + s * v_step, lane);
    }
  }
}
