// Tree attention over several requests' blocks at once: body for mx.fast.metal_kernel (MLX
// generates the signature; header: tree_attention_common.metal).
//
// The rows of every request's block are concatenated; each row reads its own request's slot of
// a KV pool through a per-row table {slot, context, block rows}: the committed keys [0, context)
// of its slot, then its block's keys, which the cache write put right after them, by its own
// ancestor bits. A row never reads past context + block rows, so a slot's stale tail (keys of
// an earlier, longer block) is never attended, and no row sees another request's keys.
//
// inputs : q (1, H, R, D) row-contiguous; k, v (S, H_kv, >= max context + rows, D) strided
//          views of the pool; bits (R, W) uint32, each row's over its own block; table (R, 3)
//          int32; scale float32
// outputs: out (1, H, R, D)
// template: T (dtype), D (head dim, multiple of 32), GQA (H / H_kv), W (words per bits row)
// grid (32 * R, H, 1), threadgroup (32, 1, 1)

uint lane = thread_index_in_simdgroup;
uint row = threadgroup_position_in_grid.x;
uint head = threadgroup_position_in_grid.y;
int rows = q_shape[2];
int slot = table[row * 3];
int context = table[row * 3 + 1];
int block = table[row * 3 + 2];
constexpr int E = D / 32;

float qv[E];
float acc[E];
load_query<T, E>(qv, acc, q + (size_t(head) * rows + row) * D, scale[0], lane);
float m = -INFINITY;
float l = 0.0f;
uint kv_head = head / GQA;
attend_range<T, E>(qv, acc, m, l, 0, context + block, context, bits + row * W,
                   k + slot * k_strides[0] + kv_head * k_strides[1],
                   v + slot * v_strides[0] + kv_head * v_strides[1], k_strides[2],
                   v_strides[2], lane);
device T* op = out + (size_t(head) * rows + row) * D;
for (int e = 0; e < E; e++) {
  op[lane * E + e] = T(acc[e] / l);
}
