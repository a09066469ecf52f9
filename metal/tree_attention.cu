// Tree attention, single pass: CUDA twin of tree_attention.metal for mx.fast.cuda_kernel (same
// inputs, outputs, template arguments and grid; header: tree_attention_common.cuh).

int lane = threadIdx.x;
int row = blockIdx.x;
int head = blockIdx.y;
int rows = q_shape[2];
int context = meta[0];
constexpr int E = D / 32;

float qv[E];
float acc[E];
load_query<T, E>(qv, acc, q + ((size_t)head * rows + row) * D, scale[0], lane);
float m = -inf;  // `inf`: defined by the header mx.fast.cuda_kernel puts first
float l = 0.0f;
int kv_head = head / GQA;
attend_range<T, E>(qv, acc, m, l, 0, context + rows, context, bits + (size_t)row * W,
                   k + kv_head * k_strides[1], v + kv_head * v_strides[1], k_strides[2],
                   v_strides[2], lane);
T* op = out + ((size_t)head * rows + row) * D;
for (int e = 0; e < E; e++) {
  op[lane * E + e] = static_cast<T>(acc[e] / l);
}
