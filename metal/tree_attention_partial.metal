// Tree attention over a long context, pass 1 of 2 (flash-decoding style): body for
// mx.fast.metal_kernel (header: tree_attention_common.metal).
//
// [committed context + block] is cut into chunks of meta[1] keys; one simdgroup per (block
// row, query head, chunk) folds its chunk and writes the unnormalised state (running max,
// running sum, weighted value sum). tree_attention_combine merges the chunks. A single
// simdgroup walking 4-8K keys would leave most of an Apple GPU idle.
//
// inputs : as tree_attention, meta int32 {context, chunk}
// outputs: part_acc (H, R, S, D) float32; part_max, part_sum (H, R, S) float32; S = chunks
// template: T, D, GQA, W as tree_attention
// grid (32 * R, H, S), threadgroup (32, 1, 1)

uint lane = thread_index_in_simdgroup;
uint row = threadgroup_position_in_grid.x;
uint head = threadgroup_position_in_grid.y;
uint chunk = threadgroup_position_in_grid.z;
uint chunks = threadgroups_per_grid.z;
int rows = q_shape[2];
int context = meta[0];
int chunk_keys = meta[1];
constexpr int E = D / 32;

float qv[E];
float acc[E];
load_query<T, E>(qv, acc, q + (size_t(head) * rows + row) * D, scale[0], lane);
float m = -INFINITY;
float l = 0.0f;
int lo = int(chunk) * chunk_keys;
int hi = metal::min(lo + chunk_keys, context + rows);
uint kv_head = head / GQA;
attend_range<T, E>(qv, acc, m, l, lo, hi, context, bits + row * W,
                   k + kv_head * k_strides[1], v + kv_head * v_strides[1], k_strides[2],
                   v_strides[2], lane);
size_t slot = (size_t(head) * rows + row) * chunks + chunk;
for (int e = 0; e < E; e++) {
  part_acc[slot * D + lane * E + e] = acc[e];
}
if (lane == 0) {
  part_max[slot] = m;
  part_sum[slot] = l;
}
