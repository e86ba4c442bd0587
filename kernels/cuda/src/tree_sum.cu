// The exact data-parallel sum on the device: `world` buffers of `n` f32 gathered side by side
// (parts[r·n + i], rank order) summed element-wise by the pairwise tree of
// trainer/src/dist/tree.rs — left to right, level by level, (a + b) + (c + d) for four ranks —
// built the way its TreeAccumulator builds it for any count: a binary counter of partial sums
// (pushing leaf r completes one subtree per trailing one bit of r), the partials folded from the
// right at the end. Every add rounds on its own (__fadd_rn), so each rank, and the host's tree,
// get the same bits.
#include <stdint.h>

// Partial sums held at once: one per bit of the rank count.
#define MAX_LEVELS 32

extern "C" __global__ void tree_sum_f32(const float *__restrict__ parts, float *__restrict__ out, uint64_t n,
                                        uint32_t world) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float stack[MAX_LEVELS];
        uint32_t top = 0;
        for (uint32_t r = 0; r < world; ++r) {
            float node = parts[(uint64_t)r * n + i];
            for (uint32_t c = r; c & 1u; c >>= 1) node = __fadd_rn(stack[--top], node);
            stack[top++] = node;
        }
        float acc = stack[top - 1];
        for (int j = (int)top - 2; j >= 0; --j) acc = __fadd_rn(stack[j], acc);
        out[i] = acc;
    }
}
