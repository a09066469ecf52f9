// Shared by the CUDA tree-attention bodies (the `header` of every mx.fast.cuda_kernel here);
// the twin of tree_attention_common.metal: one warp per (block row, query head), lane i holds
// head-dim elements [i * E, (i + 1) * E), online softmax state (m, l, acc).

// Loads the lane's slice of a query row, pre-scaled, and clears its accumulator.
template <typename T, int E>
__device__ __forceinline__ void load_query(float* qv, float* acc, const T* qp, float scale,
                                           int lane) {
  for (int e = 0; e < E; e++) {
    qv[e] = static_cast<float>(qp[lane * E + e]) * scale;
    acc[e] = 0.0f;
  }
}

// Folds key / value row s into the lane's online-softmax state.
template <typename T, int E>
__device__ __forceinline__ void attend_key(const float* qv, float* acc, float& m, float& l,
                                           const T* kp, const T* vp, int lane) {
  float d = 0.0f;
  for (int e = 0; e < E; e++) {
    d += qv[e] * static_cast<float>(kp[lane * E + e]);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    d += __shfl_xor_sync(0xffffffffu, d, offset);
  }
  float m_new = fmaxf(m, d);
  float correction = __expf(m - m_new);
  float p = __expf(d - m_new);
  l = l * correction + p;
  for (int e = 0; e < E; e++) {
    acc[e] = acc[e] * correction + p * static_cast<float>(vp[lane * E + e]);
  }
  m = m_new;
}

// Folds keys [lo, hi) of [committed context + block]: committed positions without a mask
// test, block column j = s - context when bit j of the row's ancestor bits is set.
template <typename T, int E>
__device__ __forceinline__ void attend_range(const float* qv, float* acc, float& m, float& l,
                                             int lo, int hi, int context,
                                             const uint32_t* row_bits, const T* kb,
                                             const T* vb, int64_t k_step, int64_t v_step,
                                             int lane) {
  int committed_end = hi < context ? hi : context;
  for (int s = lo; s < committed_end; s++) {
    attend_key<T, E>(qv, acc, m, l, kb + s * k_step, vb + s * v_step, lane);
  }
  for (int s = lo > context ? lo : context; s < hi; s++) {
    int j = s - context;
    if (((row_bits[j >> 5] >> (j & 31)) & 1u) != 0u) {
      attend_key<T, E>(qv, acc, m, l, kb + s * k_step, vb + s * v_step, lane);
    }
  }
}
