// Tree attention over a long context, pass 2 of 2: merges the chunks' states from
// tree_attention_partial into the output. Body for mx.fast.metal_kernel.
//
// Chunk i's state (m_i, l_i, acc_i) rescales to the overall maximum M: out = sum_i
// exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i. A chunk with no visible key has m_i = -inf and
// weighs exactly 0 (MLX's default "safe" math keeps exp(-inf) == 0).
//
// inputs : part_acc (H, R, S, D), part_max, part_sum (H, R, S) float32
// outputs: out (1, H, R, D)
// template: T (output dtype), D
// grid (32 * R, H, 1), threadgroup (32, 1, 1)

uint lane = thread_index_in_simdgroup;
uint row = threadgroup_position_in_grid.x;
uint head = threadgroup_position_in_grid.y;
int rows = part_max_shape[1];
int chunks = part_max_shape[2];
constexpr int E = D / 32;

size_t first = (size_t(head) * rows + row) * chunks;
float m = -INFINITY;
for (int i = 0; i < chunks; i++) {
  m = metal::max(m, part_max[first + i]);
}
float l = 0.0f;
float acc[E];
for (int e = 0; e < E; e++) {
  acc[e] = 0.0f;
}
for (int i = 0; i < chunks; i++) {
  float w = metal::exp(part_max[first + i] - m);
  l += w * part_sum[first + i];
  for (int e = 0; e < E; e++) {
    acc[e] += w * part_acc[(first + i) * D + lane * E + e];
  }
}
device T* op = out + (size_t(head) * rows + row) * D;
for (int e = 0; e < E; e++) {
  op[lane * E + e] = T(acc[e] / l);
}
