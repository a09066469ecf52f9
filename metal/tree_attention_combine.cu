// Tree attention over a long context, pass 2 of 2: CUDA twin of tree_attention_combine.metal.

int lane = threadIdx.x;
int row = blockIdx.x;
int head = blockIdx.y;
int rows = part_max_shape[1];
int chunks = part_max_shape[2];
constexpr int E = D / 32;

size_t first = ((size_t)head * rows + row) * chunks;
float m = -inf;  // `inf`: defined by the header mx.fast.cuda_kernel puts first
for (int i = 0; i < chunks; i++) {
  m = fmaxf(m, part_max[first + i]);
}
float l = 0.0f;
float acc[E];
for (int e = 0; e < E; e++) {
  acc[e] = 0.0f;
}
for (int i = 0; i < chunks; i++) {
  float w = __expf(part_max[first + i] - m);
  l += w * part_sum[first + i];
  for (int e = 0; e < E; e++) {
    acc[e] += w * part_acc[(first + i) * D + lane * E + e];
  }
}
T* op = out + ((size_t)head * rows + row) * D;
for (int e = 0; e < E; e++) {
  op[lane * E + e] = static_cast<T>(acc[e] / l);
}
