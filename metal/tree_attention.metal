// Tree attention, single pass: body for mx.fast.metal_kernel (MLX generates the signature;
// header: tree_attention_common.metal).
//
// One simdgroup per (block row, query head) walks the whole [committed context + block]: right
// for short contexts; long ones go to tree_attention_partial + tree_attention_combine.
//
// inputs : q (1, H, R, D) row-contiguous; k, v (1, H_kv, >= context + R, D) strided views of
//          the KV cache; bits (R, W) uint32 ancestor bits; meta int32 {context}; scale float32
// outputs: out (1, H, R, D)
// template: T (dtype), D (head dim, multiple of 32), GQA (H / H_kv), W (words per bits row)
// grid (32 * R, H, 1), threadgroup (32, 1, 1)

uint lane = thread_index_in_simdgroup;
uint row = threadgroup_position_in_grid.x;
uint head = threadgroup_position_in_grid.y;
int rows = q_shape[2];
int context = meta[0];
constexpr int E = D / 32;

float qv[E];
float acc[E];
load_query<T, E>(qv, acc, q + (size_t(head) * rows + row) * D, scale[0], lane);
float m = -INFINITY;
float l = 0.0f;
uint kv_head = head / GQA;
attend_range<T, E>(qv, acc, m, l, 0, context + rows, context, bits + row * W,
                   k + kv_head * k_strides[1], v + kv_head * v_strides[1], k_strides[2],
                   v_strides[2], lane);
device T* op = out + (size_t(head) * rows + row) * D;
for (int e = 0; e < E; e++) {
  op[lane * E + e] = T(acc[e] / l);
}
