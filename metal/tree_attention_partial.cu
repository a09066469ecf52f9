// Tree attention over a long context, pass 1 of 2: CUDA twin of tree_attention_partial.metal
// (grid (32 * R, H, S): blockIdx.z is the chunk; meta int32 {context, chunk}).

int lane = threadIdx.x;
int row = blockIdx.x;
int head = blockIdx.y;
int chunk = blockIdx.z;
int chunks = gridDim.z;
int rows = q_shape[2];
int context = meta[0];
int chunk_keys = meta[1];
constexpr int E = D / 32;

float qv[E];
float acc[E];
load_query<T, E>(qv, acc, q + ((size_t)head * rows + row) * D, scale[0], lane);
float m = -inf;  // `inf`: defined by the header mx.fast.cuda_kernel puts first
float l = 0.0f;
int lo = chunk * chunk_keys;
int hi = lo + chunk_keys < context + rows ? lo + chunk_keys : context + rows;
int kv_head = head / GQA;
attend_range<T, E>(qv, acc, m, l, lo, hi, context, bits + (size_t)row * W,
                   k + kv_head * k_strides[1], v + kv_head * v_strides[1], k_strides[2],
                   v_strides[2], lane);
size_t slot = ((size_t)head * rows + row) * chunks + chunk;
for (int e = 0; e < E; e++) {
  part_acc[slot * D + lane * E + e] = acc[e];
}
if (lane == 0) {
  part_max[slot] = m;
  part_sum[slot] = l;
}
