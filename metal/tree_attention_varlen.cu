// Tree attention over several requests' blocks at once: CUDA twin of
// tree_attention_varlen.metal for mx.fast.cuda_kernel (same inputs, outputs, template
// arguments and grid; header: tree_attention_common.cuh).

int lane = threadIdx.x;
int row = blockIdx.x;
int head = blockIdx.y;
int rows = q_shape[2];
int slot = table[row * 3];
int context = table[row * 3 + 1];
int block = table[row * 3 + 2];
constexpr int E = D / 32;

float qv[E];
float acc[E];
load_query<T, E>(qv, acc, q + ((size_t)head * rows + row) * D, scale[0], lane);
float m = -inf;  // `inf`: defined by the header mx.fast.cuda_kernel puts first
float l = 0.0f;
int kv_head = head / GQA;
attend_range<T, E>(qv, acc, m, l, 0, context + block, context, bits + (size_t)row * W,
                   k + slot * k_strides[0] + kv_head * k_strides[1],
                   v + slot * v_strides[0] + kv_head * v_strides[1], k_strides[2],
                   v_strides[2], lane);
T* op = out + ((size_t)head * rows + row) * D;
for (int e = 0; e < E; e++) {
  op[lane * E + e] = static_cast<T>(acc[e] / l);
}
